"""The import rules of docs/architecture.md §1, enforced on the source tree.

Every .py file of the packages named in pyproject.toml's [tool.setuptools.package-dir] is parsed
with ``ast`` (module-level and function-level imports alike, relative imports resolved against the
file's package) and each import of a ``dsa_trt`` module is checked against the layer rules below.
A serving image needs torch, the kernel library and the runtime alone, so the runtime may not
reach build code, and build code may not depend on the serving package.

``find_violations(root)`` is the checker; the last tests run it on synthetic trees and on a
scratch copy of this repository with a forbidden import added, so "it fails" stays tested.
"""

from __future__ import annotations

import ast
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT_PACKAGE = "dsa_trt"

# layer -> the dsa_trt layers it may import (itself included); "contract" is the top-level
# dsa_trt/*.py modules (model config, engine-dir schema, step contract, cache layout, tokenizer)
ALLOWED = {
    "contract": {"contract"},
    "plugins": {"contract", "plugins"},
    "export": {"contract", "plugins", "export"},
    "calibration": {"contract", "plugins", "export", "calibration"},
    "builder": {"contract", "plugins", "export", "calibration", "builder"},
    "runtime": {"contract", "plugins", "runtime"},
}
WHY = {
    "contract": "the contract layer (dsa_trt/*.py) imports only itself",
    "plugins": "plugins imports only the contract layer",
    "export": "export imports only the contract layer and plugins",
    "calibration": "calibration imports only the contract layer, plugins and export",
    "builder": "builder imports no runtime",
    "runtime": "runtime imports only the contract layer and plugins (a serving image has no build code)",
}
# third-party packages only the builder's extras install ([project.optional-dependencies] build):
# the serving side (runtime, plugins, contract) must not need them
BUILD_ONLY = ("transformers", "modelopt", "onnx", "onnx_ir", "onnxscript", "onnxruntime", "polygraphy",
              "onnx_graphsurgeon")
SERVING_LAYERS = ("contract", "plugins", "runtime")


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    module: str  # the importing module
    target: str  # what it imports
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.target}: {self.rule}"


def package_dirs(root: Path) -> dict[str, Path]:
    """pyproject.toml's package-dir: dotted package -> its directory under ``root``."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {pkg: root / d for pkg, d in mapping.items()}


def layer_of(module: str) -> str | None:
    """dsa_trt.runtime.triton.model -> "runtime"; dsa_trt.config -> "contract"; numpy -> None."""
    parts = module.split(".")
    if parts[0] != ROOT_PACKAGE:
        return None
    if len(parts) > 1 and parts[1] in ALLOWED and parts[1] != "contract":
        return parts[1]
    return "contract"


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute dotted target) of every import in the tree, at any depth. ``from a import b``
    yields ``a.b`` (b may be a submodule); a relative import is resolved against ``package``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"line {node.lineno}: relative import beyond the top of {package}")
                anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            found += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names]
    return found


def find_violations(root: Path, dirs: dict[str, Path] | None = None) -> list[Violation]:
    """Every forbidden import edge in the packages of ``root`` (pyproject's package-dir by default)."""
    dirs = package_dirs(root) if dirs is None else dirs
    violations = []
    for package, directory in sorted(dirs.items()):
        src_layer = layer_of(package)
        for path in sorted(directory.glob("*.py")):
            module = package if path.stem == "__init__" else f"{package}.{path.stem}"
            # relative imports resolve against the package, for its __init__ and its modules alike
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, target in _imports(tree, package):
                rel = path.relative_to(root)
                layer = layer_of(target)
                if layer is not None and layer not in ALLOWED[src_layer]:
                    violations.append(Violation(rel, line, module, target, WHY[src_layer]))
                top = target.split(".")[0]
                if src_layer in SERVING_LAYERS and top in BUILD_ONLY:
                    violations.append(Violation(rel, line, module, target,
                                                f"{src_layer} is serving code: {top} is a build-only dependency"))
    return violations


# ---------------------------------------------------------------- the repository
def test_repository_follows_the_import_rules():
    violations = find_violations(REPO)
    assert not violations, "forbidden imports (docs/architecture.md §1):\n" + "\n".join(map(str, violations))


def test_every_package_file_is_checked():
    """The checker sees every package of pyproject and every subpackage folder is one of them: a new
    folder with .py files outside package-dir would escape the rules (and the wheel)."""
    dirs = package_dirs(REPO)
    assert set(dirs) >= {"dsa_trt", "dsa_trt.runtime", "dsa_trt.plugins", "dsa_trt.export", "dsa_trt.builder",
                         "dsa_trt.calibration"}
    known = {d.resolve() for d in dirs.values()}
    for d in dirs.values():
        for sub in d.iterdir():
            if sub.is_dir() and any(sub.glob("*.py")):
                assert sub.resolve() in known, f"{sub}: a Python folder that pyproject's package-dir does not list"


# ---------------------------------------------------------------- the checker itself
def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    layout = {"dsa_trt": "dsa_trt", "dsa_trt.runtime": "runtime", "dsa_trt.runtime.triton": "runtime/triton",
              "dsa_trt.export": "export", "dsa_trt.builder": "builder", "dsa_trt.plugins": "plugins",
              "dsa_trt.calibration": "calibration"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return {pkg: tmp_path / d for pkg, d in layout.items()}


def test_checker_finds_every_kind_of_forbidden_edge(tmp_path):
    dirs = _tree(tmp_path, {
        "runtime/engine.py": "import torch\n\ndef load():\n    from dsa_trt.builder.aoti import check_package\n",
        "runtime/triton/model.py": "from ...builder import aoti\nfrom ..engine import Engine\n",
        "export/program.py": "from dsa_trt.runtime.step_inputs import StepInputs\nfrom dsa_trt.step import X\n",
        "plugins/ops.py": "import dsa_trt.export.network as n\nfrom . import reference\n",
        "dsa_trt/step.py": "from dsa_trt import runtime\n",
        "calibration/kv.py": "from dsa_trt.builder import build\n",
        "builder/build.py": "from dsa_trt.calibration import kv\nfrom dsa_trt.runtime.tokenizer import Tokenizer\n",
        "runtime/cli.py": "def main():\n    import transformers\n",
    })
    found = {(str(v.path), v.line, v.target) for v in find_violations(tmp_path, dirs)}
    assert found == {
        ("runtime/engine.py", 4, "dsa_trt.builder.aoti.check_package"),  # function-level import
        ("runtime/triton/model.py", 1, "dsa_trt.builder.aoti"),  # relative, two levels up
        ("export/program.py", 1, "dsa_trt.runtime.step_inputs.StepInputs"),
        ("plugins/ops.py", 1, "dsa_trt.export.network"),
        ("dsa_trt/step.py", 1, "dsa_trt.runtime"),
        ("calibration/kv.py", 1, "dsa_trt.builder.build"),
        ("builder/build.py", 2, "dsa_trt.runtime.tokenizer.Tokenizer"),
        ("runtime/cli.py", 2, "transformers"),
    }


def test_checker_message_names_file_line_and_rule(tmp_path):
    dirs = _tree(tmp_path, {"runtime/engine.py": "\n\nfrom dsa_trt.builder.aoti import check_package\n"})
    (v,) = find_violations(tmp_path, dirs)
    assert str(v) == ("runtime/engine.py:3: dsa_trt.runtime.engine imports dsa_trt.builder.aoti.check_package: "
                      + WHY["runtime"])


def test_checker_fails_on_a_scratch_copy_with_a_forbidden_import(tmp_path):
    """The real tree, copied, passes; one added runtime import in export/program.py fails it."""
    dirs = package_dirs(REPO)
    copy = {}
    for pkg, d in dirs.items():
        dst = tmp_path / d.relative_to(REPO)
        dst.mkdir(parents=True, exist_ok=True)
        for f in d.glob("*.py"):
            shutil.copy(f, dst / f.name)
        copy[pkg] = dst
    assert find_violations(tmp_path, copy) == []
    program = tmp_path / "export" / "program.py"
    lines = program.read_text().splitlines()
    lines.append("from dsa_trt.runtime.llm import LLM  # forbidden: export imports runtime")
    program.write_text("\n".join(lines) + "\n")
    (v,) = find_violations(tmp_path, copy)
    assert (str(v.path), v.line, v.rule) == ("export/program.py", len(lines), WHY["export"])


@pytest.mark.parametrize("module, layer", [
    ("dsa_trt", "contract"), ("dsa_trt.config", "contract"), ("dsa_trt.__version__", "contract"),
    ("dsa_trt.runtime.triton.model", "runtime"), ("dsa_trt.plugins", "plugins"), ("torch", None),
    ("dsa_trt_extra", None),
])
def test_layer_of(module, layer):
    assert layer_of(module) == layer
