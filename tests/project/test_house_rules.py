"""The house rules a reader relies on, checked over the sources (docs/architecture.md): no file
over 600 lines, no function over 60 outside the Triton kernels, the model chosen by asking its
config (no type check of a model config outside the config modules), and no C++ held in a
Python string (each kernel's C++ is a source file under kernels/)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = ("moestack", "kernels", "telemetry", "scripts", "configs")
MODEL_CONFIGS = {"ModelConfig", "HFModelConfig", "ModelSchema"}
CONFIG_MODULES = {"moestack/config.py", "moestack/model.py", "moestack/interop/hf_model.py"}


def sources(*tops: str) -> list[Path]:
    return sorted(
        p for top in tops for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts
    )


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def test_no_file_over_600_lines():
    long = {
        rel(p): n for p in sources(*CODE, "tests") if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


def test_no_function_over_60_lines_outside_the_triton_kernels():
    long = {}
    for path in sources(*CODE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(
                node
            ):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long[f"{rel(path)}:{node.lineno} {node.name}"] = lines
    assert long == {}


def test_no_type_check_of_a_model_config_outside_the_config_modules():
    found = []
    for path in sources(*CODE):
        if rel(path) in CONFIG_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "isinstance"
                and len(node.args) == 2
            ):
                names = {
                    n.id if isinstance(n, ast.Name) else getattr(n, "attr", "")
                    for n in ast.walk(node.args[1])
                }
                if names & MODEL_CONFIGS:
                    found.append(f"{rel(path)}:{node.lineno}")
    assert found == []


def test_no_cpp_in_a_python_string():
    held = [rel(p) for p in sources(*CODE) if "#include <" in p.read_text()]
    assert held == []
    assert sorted(p.name for p in (REPO / "kernels").glob("*.cpp")) == [
        "host_adamw.cpp",
        "host_tiered.cpp",
    ]


def test_the_rules_catch_what_they_name(tmp_path):
    """Each check finds its fault in a planted file (so none of them passes vacuously)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    tree = ast.parse(f"def f():\n{body}\n\nisinstance(cfg.model, HFModelConfig)\n")
    fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert fns[0].end_lineno - fns[0].lineno + 1 == 62 and not is_triton_kernel(fns[0])
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "isinstance"
    ]
    assert {getattr(n, "id", "") for n in ast.walk(calls[0].args[1])} & MODEL_CONFIGS
    jit = ast.parse("@triton.jit\ndef k():\n    pass\n").body[0]
    assert is_triton_kernel(jit)
