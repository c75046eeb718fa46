"""``import npattn`` needs only NumPy: Numba, SciPy and CuPy load when a backend asks for them."""
import subprocess
import sys


def test_import_loads_no_optional_dependency():
    code = ("import sys, npattn; npattn.attention; npattn.backends(); "
            "print(sorted(m for m in ('numba', 'scipy', 'cupy', 'torch', 'jax') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_the_cpu_backend_names_a_numba_too_old_for_its_kernels(monkeypatch):
    """Before Numba 0.68 the kernels fail to compile (IntEnum indices): the backend says so
    instead, and setup.cfg asks for the same version."""
    import configparser
    import pathlib

    import npattn.cpu as cpu

    for found, expected in (("0.67.0", "numba 0.67.0 is installed"), ("0.59.1", "numba 0.59.1 is installed"),
                            ("0.68.0", None), ("0.68.1", None), ("0.70.0rc1", None), ("1.0.0", None)):
        monkeypatch.setattr(cpu, "_numba_version", lambda: found)
        reason = cpu.unavailable_reason()
        if expected is None:
            assert reason is None, found
        else:
            assert reason.startswith("needs numba>=0.68") and expected in reason, reason
    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).parents[1] / "setup.cfg")
    oldest = ".".join(map(str, cpu.OLDEST_NUMBA))
    assert f"numba>={oldest}" in config["options"]["install_requires"].split()


def test_autograd_and_optim_need_only_numpy():
    code = ("import sys, npattn.autograd, npattn.nn.optim; "
            "print(sorted(m for m in ('numba', 'scipy', 'cupy', 'torch', 'jax') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def _package_imports():
    """``{module: set of npattn modules it imports}``, read from the sources: imports at
    module level and inside functions alike (a lazy import still makes a circle)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "npattn"
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                named = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t for t in named if t in modules] or [base]
            else:
                continue
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def test_no_module_imports_itself_through_others():
    """No import circle in the package (the public API imports no adapter; the adapters
    import the API), at module level or inside functions."""
    edges = _package_imports()
    assert "npattn.adapters.arrays" not in edges["npattn.api"]
    for start in edges:
        seen, frontier = set(), [start]
        while frontier:
            for target in edges[frontier.pop()]:
                assert target != start, f"{start} imports itself through {sorted(seen)}"
                if target not in seen:
                    seen.add(target)
                    frontier.append(target)


def test_the_top_level_holds_the_public_face_only():
    """The folders are the layers (docs/architecture.rst): at most 12 modules sit directly
    under npattn/, and every folder there is a package with a docstring saying what it holds."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "npattn"
    modules = sorted(path.name for path in root.glob("*.py"))
    assert len(modules) <= 12, modules
    for folder in (path for path in root.iterdir() if path.is_dir() and not path.name.startswith("__")):
        init = folder / "__init__.py"
        assert init.exists(), f"{folder.name}/ is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{folder.name}/__init__.py has no docstring"
