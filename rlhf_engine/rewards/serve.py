"""The reference reward server: what `--reward_url` talks to (remote.py has the protocol).

    python -m rlhf_engine.rewards.serve --reward_fn rlhf_engine.rewards.math_answer:exact_answer --port 8000
    python -m rlhf_engine.rewards.serve --reward_model runs/rm/model --port 8000       (a trained reward model)

POST any path with {"prompts": [...], "responses": [...], "columns": {...}} -> {"scores": [...]}. A reward function
is called by the calling rule (its declared columns are taken from "columns"; a missing one is a 400 naming it); a
reward model (a `*ForSequenceClassification` folder, as step 2 exports) scores the text prompt + response, read at
the last token, in batches of --batch_size. A function that raises answers 500 with the error: the trainer retries
5xx, then stops naming this server. Requests are served one at a time (the model is not thread-safe); run several
servers behind a load balancer for more.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable, Optional, Sequence

from .loader import call_reward_fn, load_reward_fn, reward_signature

log = logging.getLogger("rlhf_engine.rewards.serve")


class ModelScorer:
    """A reward model folder as a reward function: the score of prompt + response at its last token."""

    def __init__(self, path: str, batch_size: int = 8, device: str = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch, self.device, self.batch_size = torch, device, int(batch_size)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.__rlhf_spec__ = f"reward model {path}"

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        out: list[float] = []
        texts = [p + r for p, r in zip(prompts, responses)]
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True).to(self.device)
            with self.torch.no_grad():
                out += self.model(**batch).logits[:, 0].float().tolist()
        return out


def handler_for(fn: Callable) -> type:
    """The request handler of a server scoring with `fn` (a reward function by the calling rule)."""
    sig = reward_signature(fn)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  (http.server's naming)
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                prompts, responses = body["prompts"], body["responses"]
                given = body.get("columns") or {}
            except (ValueError, KeyError, TypeError) as e:
                return self._answer(400, {"error": f"expected JSON with prompts, responses, columns: {e}"})
            missing = [c for c in sig.required if c not in given]
            if missing:
                return self._answer(400, {"error": f"the reward function needs the columns {missing}; the request "
                                                   f"has {sorted(given)}"})
            wanted = (given if sig.all_columns
                      else {c: v for c, v in given.items() if c in sig.required + sig.optional})
            try:
                scores = call_reward_fn(fn, prompts, responses, wanted)
            except Exception as e:  # noqa: BLE001  (the client retries 5xx, then names this server and the error)
                log.exception("scoring failed")
                return self._answer(500, {"error": f"{type(e).__name__}: {e}"})
            self._answer(200, {"scores": scores})

        def _answer(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug(fmt, *args)

    return Handler


def make_server(fn: Callable, host: str = "127.0.0.1", port: int = 0) -> HTTPServer:
    """A server scoring with `fn`, bound (port 0: a free one, read back from `server.server_port`); call
    `serve_forever()`."""
    return HTTPServer((host, port), handler_for(fn))


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--reward_fn", help="'module:function' reward function (the calling rule)")
    which.add_argument("--reward_model", help="a *ForSequenceClassification folder (step 2's exported model)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    ap.add_argument("--batch_size", type=int, default=8, help="reward model: sequences per forward")
    ap.add_argument("--device", default="cpu", help="reward model: torch device (cuda:0, ...)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        fn = load_reward_fn(args.reward_fn) if args.reward_fn else ModelScorer(args.reward_model, args.batch_size,
                                                                                args.device)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = make_server(fn, args.host, args.port)
    print(f"serving {getattr(fn, '__rlhf_spec__', args.reward_fn)} on http://{args.host}:{server.server_port}/",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
