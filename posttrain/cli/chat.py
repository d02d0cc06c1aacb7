"""`posttrain chat`: talk to a model on the terminal. Each line read from stdin is a user turn; the kept
history is rendered with the model's chat template and the reply is sampled by the RL rollout engine
(`posttrain.trainers.inference`). `/reset` clears the history; end of input (Ctrl-D) or Ctrl-C ends with
status 0. Flags: `posttrain chat --help` (`posttrain.config.inference.ChatConfig`)."""
from __future__ import annotations

import dataclasses
import sys

from posttrain.cli.errors import user_errors

PROG = "posttrain chat"
RESET = "/reset"


def main(argv: list[str] | None = None, stdin=None, stdout=None) -> list[dict]:
    """Run the conversation over `stdin` / `stdout` (default: the process's); returns the history at the end.
    Bad flags or model folders end in one `posttrain chat: error:` line and exit status 2."""
    from posttrain.config import parse_config
    from posttrain.trainers.inputs import check_sampling_inputs

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    with user_errors(PROG):
        cfg = parse_config("chat", sys.argv[1:] if argv is None else argv)
        check_sampling_inputs(cfg)
        from posttrain.trainers.inference import Policy, sampling_params

        policy = Policy(cfg).start()
    params = dataclasses.replace(sampling_params(cfg), n=1)
    history: list[dict] = []
    interactive = stdin.isatty()
    try:
        print(f"chatting with {policy.path}: type a message; {RESET} clears the history, Ctrl-D ends",
              file=stdout, flush=True)
        while True:
            if interactive:
                print("> ", end="", file=stdout, flush=True)
            line = stdin.readline()
            if not line:
                break
            text = line.rstrip("\n")
            if text.strip() == RESET:
                history.clear()
                print("(history cleared)", file=stdout, flush=True)
                continue
            if not text.strip():
                continue
            history.append({"role": "user", "content": text})
            ids = policy.encode(policy.render(history))
            (out,), = policy.engine.generate([ids], params)
            reply = policy.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
            history.append({"role": "assistant", "content": reply})
            print(reply, file=stdout, flush=True)
    except KeyboardInterrupt:
        print(file=stdout)
    return history


if __name__ == "__main__":
    main()
