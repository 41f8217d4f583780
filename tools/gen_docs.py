"""The generated sections of the docs: the hook catalog table of docs/hooks.md (from
``megatron/core/dmi/catalog.py``) and the ``--dmi-*`` flag table of docs/usage.md (from the real
parser of ``megatron/training/dmi/arguments.py``). A repository tool, not part of the installed
package: it reads the catalog and the training flags and writes files under docs/.

    python tools/gen_docs.py            # check: exit 1 if a section is out of date
    python tools/gen_docs.py --update   # rewrite them
"""

from __future__ import annotations

import argparse
import os
import sys

DOCS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs")
BEGIN = "<!-- BEGIN GENERATED: {} (python tools/gen_docs.py --update) -->"
END = "<!-- END GENERATED: {} -->"


def _fmt_default(v) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "off" if v is False else "on"
    if isinstance(v, (frozenset, tuple, list)):
        return ",".join(sorted(map(str, v))) if v else "none"
    return str(v)


_FLAG_VALUES = {
    "--dmi-hooks": "e.g. `router`, `router,attn`, `attn.q,attn.k`, `all`, `none`",
    "--dmi-store-dir": "a directory",
    "--dmi-clickhouse-url": "`http(s)://[user@]host:port`",
    "--dmi-clickhouse-database": "`[A-Za-z_][A-Za-z0-9_]*`, not `system` or `information_schema`",
    "--dmi-clickhouse-password-file": "a readable file",
    "--dmi-ingest-threads": "integer >= 1",
    "--dmi-interval": "integer >= 1",
    "--dmi-start-iter": "integer >= 1",
    "--dmi-end-iter": "integer >= start",
    "--dmi-layers": "e.g. `0,4-7`",
    "--dmi-phases": "`train`, `valid`, `train,valid`",
    "--dmi-ring-mb": "MiB (float), at least one record, at most half the host memory per process on the machine (and the free GPU memory)",
    "--dmi-block-timeout": "seconds (float) above 0, at most a week",
    "--dmi-spool-max-gb": "GiB (float) above 0; only with `--dmi-persist clickhouse`",
    "--dmi-run-id": "1-128 of `[A-Za-z0-9._-]`, starting with a letter or digit",
    "--dmi-flush-records": "integer >= 1",
    "--dmi-logits-topk": "integer >= 1",
    "--dmi-replay-routing": "`STORE[@RUN]`: a store directory or server URL, and a run id (default: its latest run)",
}


def flags_markdown() -> str:
    """Every --dmi-* flag of the real parser, with its default, choices and help."""
    from megatron.training.dmi.arguments import add_dmi_args

    parser = add_dmi_args(argparse.ArgumentParser(add_help=False))
    lines = ["| flag | default | values | what it does |", "|---|---|---|---|"]
    for a in parser._actions:
        flag = next((o for o in a.option_strings if o.startswith("--dmi-")), None)
        if flag is None:
            continue
        if a.choices:
            values = " \\| ".join(f"`{c}`" for c in a.choices)
        elif a.nargs == 0:
            values = "switch"
        else:
            values = _FLAG_VALUES.get(flag, "text")
        help_ = (a.help or "").replace("|", "\\|")
        lines.append(f"| `{flag}` | `{_fmt_default(a.default)}` | {values} | {help_} |")
    return "\n".join(lines)


def generated_sections() -> dict[str, dict[str, str]]:
    """Each doc file's generated sections: file -> {section name: generated text}."""
    from megatron.core.dmi import catalog

    return {"hooks.md": {"hook catalog": catalog.markdown_table()}, "usage.md": {"dmi flags": flags_markdown()}}


def _replace_section(text: str, name: str, body: str) -> str:
    b, e = BEGIN.format(name), END.format(name)
    if b not in text or e not in text:
        raise ValueError(f"markers for the generated section {name!r} are missing")
    head, rest = text.split(b, 1)
    _, tail = rest.split(e, 1)
    return f"{head}{b}\n{body}\n{e}{tail}"


def cmd_docs(args: argparse.Namespace) -> int:
    """Check the generated sections of the docs (``--update`` rewrites the stale ones)."""
    stale = []
    for fname, sections in generated_sections().items():
        path = os.path.join(args.docs_dir, fname)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = text
        for name, body in sections.items():
            new = _replace_section(new, name, body)
        if new != text:
            stale.append(path)
            if args.update:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    verb = "updated" if args.update else "out of date"
    for p in stale:
        print(f"{verb}: {os.path.relpath(p)}")
    if not stale:
        print("generated doc sections are current")
    return 1 if stale and not args.update else 0


def _setup_docs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--update", action="store_true", help="rewrite the generated sections (default: only check)")
    p.add_argument("--docs-dir", default=os.path.normpath(DOCS_DIR), help="the docs/ folder of the repository")
    p.set_defaults(func=cmd_docs)


def main(argv: list[str] | None = None) -> int:
    """Run this module's command line."""
    p = argparse.ArgumentParser(prog="python tools/gen_docs.py", description=__doc__.splitlines()[0])
    _setup_docs(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
