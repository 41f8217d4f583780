"""How a ClickHouse store is addressed: the server URL, the database name and the password.

Checked here without a database client, so the configuration (which every layer uses) validates
its values without importing the storage layer, and the storage layer takes its names from here.
Identifiers are spliced into SQL text, so a name passes only as a plain identifier; a password is
never part of a URL, and ``redact`` removes it (in every form it travelled in) from any text shown.
"""

from __future__ import annotations

import base64
import os
import re
import urllib.parse

from megatron.core.dmi.errors import DMIError

_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class IdentifierError(DMIError, ValueError):
    """A database or table name that is not a plain identifier."""


def check_identifier(name: str, what: str = "identifier") -> str:
    """Accept only ``[A-Za-z_][A-Za-z0-9_]{0,62}``: identifiers are spliced into SQL text, so
    nothing else (quotes, dots, spaces, backticks, unicode look-alikes) may pass."""
    if not isinstance(name, str) or not _IDENT_RE.fullmatch(name):
        raise IdentifierError(
            f"invalid {what} {name!r}: use letters, digits and '_' (not starting with a digit), at most 63 characters"
        )
    return name


# ClickHouse's own databases: DMI's tables there would be unreachable or clash with the server's.
RESERVED_DATABASES = frozenset({"system", "information_schema"})


def check_database(name: str, what: str = "database name") -> str:
    """A plain identifier that is not one of ClickHouse's reserved databases (in any case)."""
    check_identifier(name, what)
    if name.lower() in RESERVED_DATABASES:
        raise IdentifierError(f"{what} {name!r} is reserved by ClickHouse; use your own database (default: dmi)")
    return name


PASSWORD_ENV = "DMI_CLICKHOUSE_PASSWORD"
PASSWORD_FILE_ENV = "DMI_CLICKHOUSE_PASSWORD_FILE"


class StoreRunSpecError(DMIError, ValueError):
    """A ``STORE[@RUN]`` value with an empty store or run id."""


def parse_store_run(spec: str) -> tuple[str, str | None]:
    """``STORE[@RUN]`` -> (store directory or URL, run id or None for the store's latest run); the
    last ``@`` splits, so a store path may hold ``@`` itself.

    Args:
        spec: the value, e.g. of ``--dmi-replay-routing``.

    Returns:
        The store and the run id.

    Raises:
        StoreRunSpecError: an empty store or run id.
    """
    store, sep, run = spec.rpartition("@") if "@" in spec else (spec, "", "")
    if not store or (sep and not run):
        raise StoreRunSpecError(f"expected STORE[@RUN], got {spec!r}")
    return store, run or None


def check_store_run(spec: str) -> str:
    """``spec`` if it reads as ``STORE[@RUN]`` (``parse_store_run``), else raise StoreRunSpecError."""
    parse_store_run(spec)
    return spec


class ServerURLError(DMIError, ValueError):
    """A ClickHouse server URL that is not ``http(s)://[user@]host:port`` or carries a password."""


def parse_server_url(url: str) -> dict:
    """``http(s)://[user@]host:port`` -> connection kwargs. A password inside the URL is refused
    (it would sit in argv and in logs): use DMI_CLICKHOUSE_PASSWORD or a password file."""
    p = urllib.parse.urlsplit(url)
    if p.scheme not in ("http", "https"):
        raise ServerURLError(f"--dmi-clickhouse-url must start with http:// or https:// (got scheme {p.scheme!r})")
    if p.password is not None:
        raise ServerURLError(
            "--dmi-clickhouse-url must not contain a password; set DMI_CLICKHOUSE_PASSWORD or use a password file"
        )
    if not p.hostname:
        raise ServerURLError("--dmi-clickhouse-url has no host name")
    if p.path not in ("", "/") or p.query or p.fragment:
        raise ServerURLError("--dmi-clickhouse-url takes only http(s)://[user@]host:port")
    try:
        port = p.port
    except ValueError:
        raise ServerURLError("--dmi-clickhouse-url has an invalid port") from None
    secure = p.scheme == "https"
    return {
        "host": p.hostname,
        "port": port or (8443 if secure else 8123),
        "username": urllib.parse.unquote(p.username) if p.username else "default",
        "secure": secure,
    }


def resolve_password(explicit: str | None = None, password_file: str | None = None) -> str:
    """The server password: ``explicit``, else the environment, else a password file, else empty."""
    if explicit:
        return explicit
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    path = password_file or os.environ.get(PASSWORD_FILE_ENV)
    if path:
        with open(path) as f:
            return f.read().strip()
    return ""


# The value of an Authorization header however it is echoed back: raw (``Authorization: Basic x``),
# as a dict or JSON (``'authorization': 'Basic x'``), or as a query/form pair (``authorization=x``).
_AUTH_VALUE = re.compile(
    r"(?i)(\b(?:proxy-)?authorization['\"]?\s*[:=]\s*['\"]?(?:(?:basic|bearer|digest)\s+)?)[^\s'\",;}&]+"
)
# Everything between a scheme's // and the next @: a URL's user name and password, whatever they hold.
_URL_USERINFO = re.compile(r"//[^\s@]*@")
# The body of an HTTP error that did not come from ClickHouse (no exception code): a proxy's page,
# possibly echoing the request's headers; clickhouse-connect words it this way.
_FOREIGN_BODY = re.compile(r"(HTTP driver received HTTP status \d+), server response: .*", re.S)


def secret_forms(secret: str | None, username: str | None = None) -> list[str]:
    """Every form in which a request carried the password and a server may echo it: plain,
    URL-quoted, and base64 (with and without padding) of ``user:password`` (HTTP Basic) and of the
    password alone. Longest first, so no form is cut by a shorter one before it is replaced."""
    if not secret:
        return []
    forms = {secret, urllib.parse.quote(secret, safe="")}
    for raw in (f"{username or 'default'}:{secret}", secret):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            encoded = encode(raw.encode()).decode()
            forms.update((encoded, encoded.rstrip("=")))
    return sorted(forms, key=len, reverse=True)


def redact(text: str, secret: str | None, username: str | None = None) -> str:
    """``text`` safe to print, report and store: no password in any form, no Authorization header
    value, no URL user info, and no raw body of a non-ClickHouse error response."""
    for form in secret_forms(secret, username):
        text = text.replace(form, "***")
    text = _FOREIGN_BODY.sub(r"\1 (the response body is not shown: it did not come from ClickHouse)", text)
    text = _AUTH_VALUE.sub(r"\1***", text)
    return _URL_USERINFO.sub("//***@", text)
