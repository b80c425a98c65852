"""`make demo`: the local control plane, the operator and an engine; a pool tree from
examples/ (root -> extend -> branch) and an AdmissionPolicy; then `kubectl get polykvpools`.

    python scripts/demo_operator.py          # tears everything down at the end
    python scripts/demo_operator.py --keep   # leaves it running (prints how to reach it)

The cluster is the one `polykv-dev` runs (state in .run/demo/); the operator runs as a local
process logged in as its own ServiceAccount (operator/deploy/rbac.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
NS = "agents"
MASTER_KEY = "polykv-demo-master-key"  # a demo value; real clusters keep it in a Secret


def say(text: str) -> None:
    print(f"\n>> {text}", flush=True)


class Demo:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.info: dict[str, Any] = {}
        self.operator: subprocess.Popen[bytes] | None = None

    # -- cluster -------------------------------------------------------------------------

    def dev(self, *args: str) -> None:
        subprocess.run([str(VENV_BIN / "polykv-dev"), "--dir", str(self.state), *args], check=True)

    def up(self) -> None:
        say("local Kubernetes control plane (etcd, kube-apiserver, controllers, process node)")
        self.dev("up")
        self.info = json.loads((self.state / "info.json").read_text())

    def env(self, kubeconfig: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = kubeconfig or self.info["kubeconfig"]
        env["PATH"] = f"{self.info['bin_dir']}{os.pathsep}{VENV_BIN}{os.pathsep}{env['PATH']}"
        return env

    def kubectl(self, *args: str, quiet: bool = False, check: bool = True) -> str:
        out = subprocess.run(
            ["kubectl", *args], env=self.env(), capture_output=True, text=True, check=False
        )
        if check and out.returncode != 0:
            raise SystemExit(f"kubectl {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
        if not quiet:
            print(out.stdout, end="", flush=True)
        return out.stdout

    def jsonpath(self, path: str, *what: str) -> str:
        """`kubectl get WHAT -n agents -o jsonpath=PATH`."""
        return self.kubectl("get", *what, "-n", NS, "-o", f"jsonpath={path}", quiet=True)

    # -- operator ------------------------------------------------------------------------

    def install(self) -> None:
        say("CRDs (generated from the operator's models) and the operator's RBAC")
        self.kubectl("apply", "-f", str(ROOT / "crds"))
        self.kubectl(
            "wait",
            "--for=condition=Established",
            "crd",
            "-l",
            "app.kubernetes.io/part-of=polykv",
            "--timeout=60s",
            quiet=True,
        )
        self.kubectl("create", "namespace", "polykv-system", quiet=True, check=False)
        self.kubectl("apply", "-f", str(ROOT / "operator" / "deploy" / "rbac.yaml"))
        self.kubectl("create", "namespace", NS, quiet=True, check=False)
        # Engine pods must pass the restricted Pod Security profile.
        self.kubectl(
            "label",
            "--overwrite",
            "namespace",
            NS,
            "pod-security.kubernetes.io/enforce=restricted",
            quiet=True,
        )

    def start_operator(self) -> None:
        say(f"the operator (polykv-operator --namespace {NS}) as ServiceAccount polykv-operator")
        token = self.kubectl(
            "create",
            "token",
            "polykv-operator",
            "-n",
            "polykv-system",
            "--duration=24h",
            quiet=True,
        ).strip()
        cfg = yaml.safe_load(Path(self.info["kubeconfig"]).read_text())
        cfg["users"] = [{"name": "polykv-operator", "user": {"token": token}}]
        cfg["contexts"][0]["context"]["user"] = "polykv-operator"
        path = self.state / "operator.kubeconfig"
        path.write_text(yaml.safe_dump(cfg))
        path.chmod(0o600)
        env = self.env(str(path))
        env.update(POLYKV_OPERATOR_MASTER_KEY=MASTER_KEY, POLYKV_OPERATOR_POLL_INTERVAL="1")
        log = (self.state / "operator.log").open("ab")
        self.operator = subprocess.Popen(
            [str(VENV_BIN / "polykv-operator"), "--namespace", NS],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # Its pid on disk: whoever runs the demo can stop it even if the demo itself dies.
        (self.state / "operator.pid").write_text(f"{self.operator.pid}\n")
        print(f"   log: {self.state / 'operator.log'} (pid {self.operator.pid})")

    def stop_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(20)
            except subprocess.TimeoutExpired:
                self.operator.kill()

    # -- the show ------------------------------------------------------------------------

    def apply_examples(self) -> None:
        for name, what in (
            ("engine.yaml", "a PolyKVEngine on SmolLM2-135M-Instruct (fetched from PyPI)"),
            ("pools.yaml", "a pool tree: crew (root) -> planner (extend), shell-crew (branch)"),
            ("admission.yaml", "an AdmissionPolicy: 5 tokens/s per session, enforced"),
        ):
            say(f"kubectl apply -f examples/{name}   # {what}")
            self.kubectl("apply", "-n", NS, "-f", str(ROOT / "examples" / name))

    def wait_ready(self) -> None:
        say("waiting for the engine and every pool to be Ready")
        t0 = time.monotonic()
        for kind in ("polykvengines", "polykvpools", "admissionpolicies"):
            self.kubectl(
                "wait",
                "-n",
                NS,
                "--for=condition=Ready",
                kind,
                "--all",
                "--timeout=180s",
                quiet=True,
            )
        print(f"   ready in {time.monotonic() - t0:.1f}s")

    def attach(self) -> None:
        question = "In one sentence: what is a KV cache?"
        say(f"an agent on pool 'planner' (by name, OpenAI chat API) asks: {question}")
        docs = list(yaml.safe_load_all((ROOT / "examples" / "pools.yaml").read_text()))
        crew, planner = docs[0]["spec"], docs[1]["spec"]
        uid = self.jsonpath("{.metadata.uid}", "polykvengine/demo")
        from polykv_operator.manifests import admin_key

        key = admin_key(MASTER_KEY, NS, "demo", uid)
        ip = self.jsonpath("{.items[0].status.podIP}", "pods", "-l", "polykv.io/engine=demo")
        messages = [
            *crew["messages"],
            *planner["appendMessages"],
            {"role": "user", "content": question},
        ]
        r = httpx.post(
            f"http://{ip}:8080/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}", "x-session-id": "agent-1"},
            json={
                "pool_id": "planner",
                "messages": messages,
                "tools": crew["tools"],  # as written in pools.yaml: any key order reuses
                # The tools stay in the prompt (the pool's prefix holds them), but this turn
                # answers in words: a 135M model otherwise reaches for `search` on anything.
                "tool_choice": "none",
                "max_tokens": 64,
                "temperature": 0,
            },
            timeout=120,
        )
        if r.status_code != 200:
            raise SystemExit(f"the engine answered {r.status_code}: {r.text}")
        body = r.json()
        answer = (body["choices"][0]["message"]["content"] or "").strip()
        print(f"   answer ({body['choices'][0]['finish_reason']}): {answer}")
        if not answer:
            raise SystemExit("the agent got an empty answer")
        t = body["timings"]
        prefix_len = int(self.jsonpath("{.status.prefixLen}", "polykvpool/planner"))
        print(
            f"   prompt tokens from the pool: {t['cache_n']} (its prefix: {prefix_len}), "
            f"computed for this session: {t['prompt_n']}"
        )
        if t["cache_n"] < prefix_len - 1:
            raise SystemExit(f"the session reused {t['cache_n']} of {prefix_len} pool tokens")

    def show(self) -> None:
        say(f"kubectl get polykv -n {NS}")
        self.kubectl("get", "polykv", "-n", NS)
        time.sleep(2.5)  # one status refresh after the attach
        say(f"kubectl get polykvpools -n {NS}   # the tree")
        self.kubectl("get", "polykvpools", "-n", NS)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keep", action="store_true", help="leave the cluster and operator running")
    p.add_argument("--dir", type=Path, default=ROOT / ".run" / "demo", help="state directory")
    args = p.parse_args()
    demo = Demo(args.dir.resolve())
    demo.up()
    ok = False
    try:
        demo.install()
        demo.start_operator()
        demo.apply_examples()
        demo.wait_ready()
        demo.attach()
        demo.show()
        ok = True
    finally:
        if args.keep and ok:
            say("left running:")
            print(f"   export KUBECONFIG={demo.info['kubeconfig']}")
            print(f"   export PATH={demo.info['bin_dir']}:$PATH")
            print(f"   kubectl get polykvpools -n {NS}")
            print(
                f"   operator pid {demo.operator.pid if demo.operator else '?'}; stop all "
                f"with: kill {demo.operator.pid if demo.operator else ''}; "
                f"polykv-dev --dir {demo.state} down"
            )
        else:
            say("tearing down")
            demo.stop_operator()
            demo.dev("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
