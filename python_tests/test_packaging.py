"""Packaging (issue 11 item 5): the kernel library needs torch only (the trainer's and the
experiments' dependencies are extras), ``_C`` records the torch it was built for and a mismatch is
an ImportError saying how to rebuild, one ``__version__``."""
import os
import re
import subprocess
import sys

import pytest
import tomllib
import torch

import ist_kernels
from ist_kernels import _build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRAS_ONLY = {"numpy", "scikit-learn", "tqdm", "pyyaml", "matplotlib"}


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _name(requirement):
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def _python(code, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def test_every_op_runs_without_the_extras():
    """matplotlib, scikit-learn, tqdm, pyyaml, numpy and triton unimportable (a fresh install with no
    extras, CPU torch): ist_kernels and its library subpackages import, every op runs forward and
    backward and matches the float64 references, and none of those modules gets imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "python_tests", "no_extras_worker.py")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.split()[:1] == ["ok"], p.stdout + p.stderr
    assert int(p.stdout.split()[1]) >= 10, p.stdout


def test_dependencies_torch_only_and_extras():
    project = _pyproject()["project"]
    assert [_name(r) for r in project["dependencies"]] == ["torch"]
    extras = project["optional-dependencies"]
    assert EXTRAS_ONLY <= {_name(r) for r in extras["train"]}
    assert {"numpy", "matplotlib", "tqdm"} <= {_name(r) for r in extras["experiments"]}
    assert [_name(r) for r in extras["triton"]] == ["triton"]
    assert [_name(r) for r in extras["hf"]] == ["transformers"]
    # the test extra pulls the others in; requirements.txt (tools/setup.sh) installs all of it
    assert "ist_kernels[train,experiments,triton,hf]" in extras["test"]
    assert "ist_kernels[test]" in extras["dev"]
    wanted = {_name(r) for name in ("train", "experiments", "triton", "hf", "test", "dev") for r in extras[name]}
    wanted.discard("ist_kernels")
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        listed = {_name(ln) for ln in f if ln.strip() and not ln.startswith("#")}
    assert wanted <= listed, wanted - listed
    assert "torch" not in listed  # tools/setup.sh installs torch itself, never a CUDA wheel by accident


def _unconditional_requirements(dist):
    """The requirements of an installed distribution that apply without extras on this machine."""
    from packaging.requirements import Requirement

    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def test_requirements_never_pull_torch():
    """What requirements.txt installs (every extra, transformers included), and everything those
    packages depend on in turn, needs no torch: tools/setup.sh's `pip install -r requirements.txt`
    cannot replace the installed torch (e.g. with a CUDA wheel from PyPI). Walks the installed
    distributions' metadata (tools/setup.sh installed them)."""
    import importlib.metadata as md

    with open(os.path.join(ROOT, "requirements.txt")) as f:
        todo = [_name(ln) for ln in f if ln.strip() and not ln.startswith("#")]
    assert "transformers" in todo
    seen, missing, path = set(), [], {}
    while todo:
        name = todo.pop().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        for dep in _unconditional_requirements(dist):
            dep = dep.lower().replace("_", "-")
            path.setdefault(dep, name)
            todo.append(dep)
    if "transformers" in missing:
        pytest.skip("transformers is not installed (tools/setup.sh installs requirements.txt)")
    pulled = sorted(n for n in seen if n == "torch" or n.startswith(("nvidia-", "torch-")))
    assert not pulled, {n: f"required by {path.get(n)}" for n in pulled}


def test_version_single_source():
    meta = _pyproject()
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ist_kernels._version.__version__"}
    with open(os.path.join(ROOT, "ist_kernels", "_version.py")) as f:
        written = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)
    assert ist_kernels.__version__ == written
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc|\.dev|\.post)?\d*", written)


def test_extension_records_the_torch_it_was_built_for():
    assert ist_kernels._C.torch_version == torch.__version__
    assert ist_kernels._C.cuda_version in ("", torch.version.cuda)


@pytest.mark.parametrize("built, installed, complaint", [
    (("2.13.0+cpu", None), ("2.13.0+cpu", None), None),
    (("2.13.0+cpu", None), ("2.13.0+cu128", "12.8"), None),  # a CPU build runs with a CUDA torch
    (("2.13.0+cu128", "12.8"), ("2.13.0+cu128", "12.8.1"), None),
    (("2.13.0+cpu", None), ("2.12.1+cpu", None), "built against torch 2.13.0+cpu, but torch 2.12.1+cpu"),
    (("2.13.0.dev20260101", None), ("2.13.0.dev20260102", None), "built against torch 2.13.0.dev20260101"),
    (("2.13.0+cu128", "12.8"), ("2.13.0+cpu", None), "built with CUDA 12.8, but the installed torch 2.13.0+cpu "
                                                     "has no CUDA"),
    (("2.13.0+cu126", "12.6"), ("2.13.0+cu128", "12.8"), "built with CUDA 12.6, but the installed torch "
                                                         "2.13.0+cu128 uses CUDA 12.8"),
])
def test_mismatch_rules(built, installed, complaint):
    why = _build.mismatch(*built, *installed)
    assert why is None if complaint is None else complaint in why, why


def test_import_refuses_an_extension_built_for_another_torch():
    """The installed torch claims another version than the one _C recorded: ImportError naming both
    and the rebuild command, before any op is registered from Python."""
    p = _python("import torch; torch.__version__ = '2.99.0+cpu'\nimport ist_kernels")
    assert p.returncode != 0 and "ImportError: ist_kernels._C does not match the installed torch" in p.stderr, p.stderr
    assert f"built against torch {torch.__version__}, but torch 2.99.0+cpu is installed" in p.stderr, p.stderr
    assert "pip install --no-build-isolation -e ." in p.stderr, p.stderr


@pytest.mark.parametrize("error, expected", [
    ("ImportError('/x/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEa')",
     "ist_kernels._C cannot be loaded (/x/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEa); it was probably "
     "built for another torch"),
    ("ModuleNotFoundError(\"No module named 'ist_kernels._C'\", name='ist_kernels._C')",
     "ist_kernels._C, the compiled extension, is not built"),
])
def test_import_explains_an_extension_that_does_not_load(error, expected):
    """_C missing, or failing to load (undefined symbols of another torch): an ImportError that
    says so and how to rebuild."""
    code = f"""
import importlib.abc, sys
class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ist_kernels._C":
            raise {error}
sys.meta_path.insert(0, Broken())
import ist_kernels
"""
    p = _python(code)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and last.startswith("ImportError: " + expected), p.stderr
    assert "pip install --no-build-isolation -e ." in last, last


def test_extras_table_matches_pyproject_and_entry_point():
    """ist_kernels/_extras.py names the distributions of pyproject's [train] and [experiments], and
    ist-train enters through ist_kernels._console.ist_train (the trainer, when they are installed)."""
    from ist_kernels import _extras

    project = _pyproject()["project"]
    for extra in ("train", "experiments"):
        assert set(_extras.EXTRAS[extra].values()) == {_name(r) for r in project["optional-dependencies"][extra]}
    assert project["scripts"]["ist-train"] == "ist_kernels._console:ist_train"
    p = _python("from ist_kernels._console import ist_train; ist_train(['--list-methods'])")
    assert p.returncode == 0 and {"localsgd", "ddp"} <= set(p.stdout.split()), p.stderr


BLOCK_NUMPY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numpy", "tqdm"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
sys.meta_path.insert(0, Block())
"""


@pytest.mark.parametrize("argv, line", [
    (["-m", "ist_kernels.train", "--list-methods"], "ist_kernels.train needs numpy: pip install 'ist_kernels[train]'"),
    (["-m", "ist_kernels.experiments", "--help"],
     "ist_kernels.experiments needs numpy, tqdm: pip install 'ist_kernels[experiments]'"),
    (["-c", "from ist_kernels._console import ist_train; ist_train()", "--list-methods"],
     "ist-train needs numpy, tqdm: pip install 'ist_kernels[train]'"),
])
def test_trainer_without_its_extra_says_which_in_one_line(tmp_path, argv, line):
    """numpy and tqdm not installed (a sitecustomize hides them from the interpreter, so `python -m`
    runs as a user's would): ist-train and python -m of the trainer and the experiments end with the
    one line naming the extra, no traceback; ist-train with status 2. (python_tests/no_extras_worker.py
    checks the imports' ImportError with every extra's module hidden.)"""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_NUMPY)
    path = os.pathsep.join(p for p in (str(tmp_path), ROOT, os.environ.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=path, PYTHONWARNINGS="ignore::UserWarning"))
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == (2 if argv[0] == "-c" else 1), p.stderr
    ours = [ln for ln in p.stderr.splitlines() if "ist_kernels[" in ln]
    assert len(ours) == 1 and line in ours[0], p.stderr  # python -m: runpy's one line around it
    if argv[0] == "-c":
        assert p.stderr.strip() == line
