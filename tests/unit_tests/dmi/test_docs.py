"""The operating docs cannot drift from the code: generated sections are current, every --dmi-*
flag and every hook output is documented, every error DMI raises is in troubleshooting.md, and
every pretrain_gpt.py command of usage.md parses with Megatron's real parser plus the DMI group."""

import argparse
import importlib.util
import os
import re
import shlex
import sys
from unittest import mock

import pytest

from megatron.core.dmi import catalog
from megatron.training.dmi.arguments import add_dmi_args
from megatron.training.dmi.entry import extra_args_provider
from tests.functional_tests.launch import tiny_moe_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DOCS = os.path.join(REPO, "docs")
# The generator is a repository tool (tools/gen_docs.py), not a module of the installed package.
_GEN_SPEC = importlib.util.spec_from_file_location("gen_docs", os.path.join(REPO, "tools", "gen_docs.py"))
docs_gen = importlib.util.module_from_spec(_GEN_SPEC)
_GEN_SPEC.loader.exec_module(docs_gen)
DOC_FILES = [
    "install.md",
    "usage.md",
    "hooks.md",
    "storage.md",
    "troubleshooting.md",
    "capabilities.md",
    "reliability.md",
]


def _read(name: str) -> str:
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return f.read()


def _all_docs() -> str:
    return "\n".join(_read(n) for n in DOC_FILES)


def _dmi_flags() -> list[str]:
    parser = add_dmi_args(argparse.ArgumentParser())
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--dmi-")]


def test_doc_files_exist():
    for name in DOC_FILES:
        assert os.path.getsize(os.path.join(DOCS, name)) > 500, name


def test_generated_sections_are_current():
    for fname, sections in docs_gen.generated_sections().items():
        text = _read(fname)
        for name, body in sections.items():
            block = text.split(docs_gen.BEGIN.format(name), 1)[1].split(docs_gen.END.format(name), 1)[0]
            assert block.strip() == body.strip(), f"{fname}: run `python tools/gen_docs.py --update`"


def test_hooks_md_holds_exactly_the_catalog_table():
    assert catalog.markdown_table() in _read("hooks.md")


def test_every_dmi_flag_is_documented_with_its_default():
    usage = _read("usage.md")
    parser = add_dmi_args(argparse.ArgumentParser())
    for a in parser._actions:
        flag = next((o for o in a.option_strings if o.startswith("--dmi-")), None)
        if flag:
            row = next((ln for ln in usage.splitlines() if ln.startswith(f"| `{flag}` |")), None)
            assert row is not None, flag
            assert f"`{docs_gen._fmt_default(a.default)}`" in row, (flag, row)
    assert len(_dmi_flags()) >= 16


def test_every_hook_output_and_group_is_documented():
    docs = _all_docs()
    for o in catalog.OUTPUTS:
        assert f"`{o.name}`" in docs, o.name
    for g in catalog.GROUPS:
        assert f"`{g}`" in docs, g


def test_docs_link_each_other():
    usage = _read("usage.md")
    for target in ("install.md", "storage.md", "hooks.md"):
        assert f"({target}" in usage, target
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for name in ("troubleshooting.md", "capabilities.md", "reliability.md", "install.md", "storage.md"):
        assert f"(docs/{name})" in readme or f"({name}" in _all_docs(), name


# -- troubleshooting covers what DMI prints --------------------------------------------------------
def _error_phrases() -> list[str]:
    """Stable fragments of the start-up errors raised in the DMI code (flag-level refuse calls and
    entry-point exits)."""
    out = []
    for path in ("megatron/training/dmi/arguments.py", "megatron/training/dmi/entry.py"):
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            src = f.read()
        out += re.findall(r'refuse\("(--dmi-[a-z-]+)"', src)
    return sorted(set(out))


def test_troubleshooting_names_every_failing_flag_and_key_messages():
    text = _read("troubleshooting.md")
    for flag in _error_phrases():
        assert f"argument {flag}:" in text, flag
    for phrase in (
        "no CUDA GPU is visible",
        "StoreBusyError",
        "schema version",
        "corrupt",
        "disk full",
        "RingTooSmallError",
        "NativeBuildError",
        "ReconstructionError",
        "cannot connect to ClickHouse",
        "IdentifierError",
        "context parallelism",
        "psutil",
        "CUDA graphs need the native transport",
    ):
        assert phrase in text, phrase


# -- every command in usage.md parses ------------------------------------------------------------
def _model_args(usage: str) -> list[str]:
    m = re.search(r"MODEL_ARGS=\((.*?)\n\)", usage, re.S)
    return shlex.split(m.group(1), comments=True)


def _pretrain_commands() -> list[list[str]]:
    usage = _read("usage.md")
    model = _model_args(usage)
    tiny = tiny_moe_args()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", usage, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "pretrain_gpt.py" not in line:
                continue
            words = shlex.split(line.split("pretrain_gpt.py", 1)[1], comments=True)
            args = []
            for w in words:
                if w == "${MODEL_ARGS[@]}":
                    args += model
                elif w == "${TINY_MOE_ARGS[@]}":
                    args += tiny
                else:
                    assert "$" not in w, f"unexpanded {w!r} in a usage.md command"
                    args.append(w)
            cmds.append(args)
    return cmds


def _parse_like_pretrain(args: list[str]) -> argparse.Namespace:
    from megatron.training.arguments import parse_args

    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *args]):
        return parse_args(extra_args_provider=extra_args_provider(), ignore_unknown_args=False)


def test_usage_has_the_recipes():
    cmds = [" ".join(c) for c in _pretrain_commands()]
    assert len(cmds) >= 12
    for needle in (
        "--dmi-hooks router ",
        "router,attn",
        "--dmi-interval",
        "--dmi-layers",
        "--recompute-granularity",
        "--cuda-graph-impl",
        "--load",
        "--dmi-clickhouse-url",
        "--dmi-persist none",
        "--dmi-persist spool",
    ):
        assert any(needle in c + " " for c in cmds), needle


@pytest.mark.parametrize("index", range(len(_pretrain_commands())))
def test_usage_command_parses(index):
    from megatron.training.dmi.arguments import check_dmi_layout

    args = _pretrain_commands()[index]
    ns = _parse_like_pretrain(args)
    assert ns.dmi_hooks, "every recipe turns DMI on"
    check_dmi_layout(ns)
    for flag in (a for a in args if a.startswith("--dmi-")):
        assert hasattr(ns, flag[2:].replace("-", "_"))


def test_a_misspelled_flag_would_not_parse():
    with pytest.raises(SystemExit) as e:
        _parse_like_pretrain(tiny_moe_args() + ["--dmi-hook", "router"])
    assert e.value.code == 2
