"""Put first on ``PYTHONPATH`` by the selftest's stages: every Python process they start records
the repository files it executes (:mod:`ncclpy.selftest.filetrace`) when ``NCCLPY_LEDGER_DIR``
is set, then runs the ``sitecustomize`` this one shadows, if any."""
import os
import sys


def _start() -> None:
    folder = os.environ.get("NCCLPY_LEDGER_DIR")
    root = os.environ.get("NCCLPY_LEDGER_ROOT")
    if not folder or not root:
        return
    try:
        import importlib.util
        # loaded by its path, so that the ncclpy package itself is recorded when imported
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "filetrace.py")
        spec = importlib.util.spec_from_file_location("ncclpy.selftest.filetrace", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mod.install(root, folder, os.environ.get("NCCLPY_LEDGER_CONTEXT", ""))
    except Exception as e:  # noqa: BLE001 - never stop a process: it just records nothing
        sys.stderr.write(f"ncclpy selftest: not recording executed files here: {e!r}\n")


def _chain() -> None:
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)


_start()
_chain()
