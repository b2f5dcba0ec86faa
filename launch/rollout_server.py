"""A rollout server: stock vLLM's OpenAI server with our settings (docs/rollout-servers.md), for a trainer started
with --rollout_servers URL[,URL...].

    python launch/rollout_server.py MODEL_FOLDER [--port 8000] [--auth_token_env NAME] [-- more vllm serve flags]

It checks its flags, then execs vLLM's server in this process (vLLM must be installed in this interpreter's
environment); `--print` shows the command instead of running it. The trainer pushes its weights before the first
request, so the folder's own weights are never sampled from. Exit codes: 2 = a bad flag (named); otherwise vLLM's.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_engine.servers.command import ServerSettings, problems, server_command, shell_line  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the actor's model folder (config, weights, generation_config)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="", help="'' = every interface with a token, 127.0.0.1 without one")
    p.add_argument("--auth_token_env", default="", help="the environment variable holding the bearer token every "
                   "route then requires (the trainer's --rollout_auth_token_env holds the same token)")
    p.add_argument("--max_model_len", type=int, default=0, help="0 = the model's; at least the trainer's longest "
                   "sequence (prompt + response), which the trainer checks at start")
    p.add_argument("--dtype", default="", help="the actor's dtype (float32, bfloat16, ...); '' = float32 on a CPU, "
                   "auto (the model's) on a GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if _cuda() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--kv_cache_mb", type=int, default=256, help="CPU only: the KV cache's size in MiB")
    p.add_argument("--served_model_name", default="")
    p.add_argument("--print", action="store_true", help="print the command and exit")
    a = p.parse_args(argv)
    s = ServerSettings(model=a.model, port=a.port, host=a.host, auth_token_env=a.auth_token_env,
                       max_model_len=a.max_model_len, dtype=a.dtype, seed=a.seed, device=a.device,
                       kv_cache_mb=a.kv_cache_mb, served_model_name=a.served_model_name, extra=tuple(extra))
    wrong = problems(s, os.environ)
    if wrong:
        for flag, message in wrong:
            print(f"rollout_server: {'MODEL' if flag == 'model' else '--' + flag}: {message}", file=sys.stderr)
        return 2
    env, command = server_command(s)
    if a.print:
        print(shell_line(env, command))
        return 0
    os.environ.update(env)
    sys.stdout.flush()
    os.execv(command[0], command)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
