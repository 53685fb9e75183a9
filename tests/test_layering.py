"""The parts' import rules: only ckpt/ imports torch, and the CLI's torch-free commands stay so."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from procs import ROOT, env

PARTS = {"tiers": set(), "recovery": {"tiers"}, "agents": {"recovery", "tiers"},
         "ckpt": {"agents", "recovery", "tiers"}}


def _imports(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_each_part_imports_only_the_parts_below_it_and_only_ckpt_imports_torch():
    for part, allowed in PARTS.items():
        for folder, _, files in os.walk(os.path.join(ROOT, part)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                got = _imports(os.path.join(folder, f))
                ours = got & set(PARTS)
                assert ours <= allowed | {part}, f"{part}/{f} imports {sorted(ours - allowed - {part})}"
                if part != "ckpt":
                    assert not got & {"torch", "torch_xla", "pickle"}, f"{part}/{f} imports {got & {'torch', 'pickle'}}"


def test_agent_list_show_verify_start_without_torch():
    code = ("import sys, ckpt, ckpt.cli, agents.daemon, agents.__main__, recovery, tiers.s3; "
            "ckpt.cli.build_parser(); assert 'torch' not in sys.modules, 'torch was imported'")
    p = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
