"""Running a kopf operator against the local cluster, in this process or as a child.

In-process (kopf.testing.KopfRunner) is quicker and shows the operator's exceptions in the
test; a subprocess is what a fault test needs (SIGKILL it mid-reconcile, start it again).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .controlplane import ControlPlane
from .lifecycle import StartStop
from .procs import ManagedProcess


def kopf_args(
    target: str | Path,
    namespace: str | None,
    extra: Sequence[str] = (),
    peering: str | None = None,
) -> list[str]:
    """`kopf run` arguments. `target` is a module name (`polykv_operator.main`) or a
    path to a .py file. Without `peering`, --standalone: no peering objects, so no peering
    CRD is needed; with it, `--peering <name>` (the KopfPeering object must exist)."""
    mode = ["--peering", peering] if peering else ["--standalone"]
    args = ["run", *mode, "--verbose"]
    args += ["--namespace", namespace] if namespace else ["--all-namespaces"]
    if isinstance(target, Path) or str(target).endswith(".py"):
        args.append(str(target))
    else:
        args += ["-m", str(target)]
    return [*args, *extra]


def _kubeconfig_registry() -> Any:
    """A fresh kopf registry whose fallback login is kopf's own kubeconfig reader.

    With the kubernetes client installed kopf would log in through it, and that client fixes
    its default kubeconfig path ($KUBECONFIG) when it is first imported: in a pytest process
    that may be before the test's cluster exists, and the login then finds no config. kopf's
    reader looks at $KUBECONFIG when it logs in. An operator's own login handlers still win."""
    from kopf._cogs.structs import ids
    from kopf._core.actions import execution
    from kopf._core.intents import causes, handlers, piggybacking
    from kopf._core.intents.registries import OperatorRegistry

    registry = OperatorRegistry()
    registry._activities.append(
        handlers.ActivityHandler(
            id=ids.HandlerId("login_with_kubeconfig"),
            fn=piggybacking.login_with_kubeconfig,
            activity=causes.Activity.AUTHENTICATION,
            errors=execution.ErrorsMode.IGNORED,
            param=None,
            timeout=None,
            retries=None,
            backoff=None,
            _fallback=True,
        )
    )
    return registry


class _IsolatedRunner:
    """A KopfRunner with a registry of its own.

    kopf registers handlers in a process-wide default registry when an operator module is
    imported, so two operators run in one pytest process would each also run the other's
    handlers (startup checks, custom logins). Each run gets a fresh registry, and a module
    target is re-imported so its handlers land in it."""

    def __init__(self, target: str | Path, runner: Any) -> None:
        self.target = target
        self.runner = runner
        self._saved: Any = None

    def __enter__(self) -> Any:
        import kopf

        self._saved = kopf.get_default_registry()
        kopf.set_default_registry(_kubeconfig_registry())
        if not (isinstance(self.target, Path) or str(self.target).endswith(".py")):
            sys.modules.pop(str(self.target), None)
        return self.runner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        import kopf

        try:
            return self.runner.__exit__(*exc)
        finally:
            kopf.set_default_registry(self._saved)


def in_process(
    target: str | Path, namespace: str | None, timeout_s: float = 120, **kwargs: Any
) -> Any:
    """A kopf.testing.KopfRunner; use it as a context manager. KUBECONFIG must point at the
    cluster in os.environ (the session fixture sets it)."""
    from kopf.testing import KopfRunner

    return _IsolatedRunner(
        target, KopfRunner(kopf_args(target, namespace), timeout=timeout_s, **kwargs)
    )


class OperatorProcess(StartStop):
    """`python -m kopf run ...` as a child process, logging to `log_path`."""

    def __init__(
        self,
        cluster: ControlPlane,
        target: str | Path,
        namespace: str | None,
        log_path: Path,
        extra_env: dict[str, str] | None = None,
        peering: str | None = None,
    ) -> None:
        env = cluster.tool_env() | (extra_env or {})
        argv = [sys.executable, "-m", "kopf", *kopf_args(target, namespace, peering=peering)]
        self.proc = ManagedProcess("operator", argv, log_path, env=env)

    def start(self) -> None:
        self.proc.start()

    def stop(self, grace_s: float = 20.0) -> None:
        self.proc.stop(grace_s)

    def kill(self) -> None:
        """SIGKILL, no cleanup: for crash-recovery tests."""
        self.proc.kill()

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace")
