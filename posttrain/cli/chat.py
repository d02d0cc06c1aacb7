"""`posttrain chat`: talk to a model on the terminal. Each line read from stdin is a user turn; the kept
history is rendered with the model's chat template and the reply is sampled by the RL rollout engine
(`posttrain.trainers.inference`). `/reset` clears the history; end of input (Ctrl-D) or Ctrl-C ends with
status 0. A conversation that outgrows the model's context (its position limit, less
--rollout.max_new_tokens for the reply) loses its oldest turns, with a one-line note (the template's own
system prompt is rendered every time, so it stays); a message that does not fit alone is answered with a
line saying so. Flags: `posttrain chat --help` (`posttrain.config.inference.ChatConfig`)."""
from __future__ import annotations

import dataclasses
import sys

from posttrain.cli.exits import user_errors

PROG = "posttrain chat"
RESET = "/reset"


def main(argv: list[str] | None = None, stdin=None, stdout=None) -> list[dict]:
    """Run the conversation over `stdin` / `stdout` (default: the process's); returns the history at the end.
    Bad flags or model folders end in one `posttrain chat: error:` line and exit status 2."""
    from posttrain.config import ConfigError, parse_config
    from posttrain.trainers.inputs import check_sampling_inputs

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    with user_errors(PROG):
        cfg = parse_config("chat", sys.argv[1:] if argv is None else argv)
        check_sampling_inputs(cfg)
        from posttrain.trainers.inference import Policy, sampling_params

        policy = Policy(cfg)
        if policy.context is not None and cfg.rollout.max_new_tokens >= policy.context:
            raise ConfigError(f"--rollout.max_new_tokens {cfg.rollout.max_new_tokens}: the model's context "
                              f"is {policy.context} tokens, prompt and reply together; pass a smaller value")
        policy.start()
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
            ids = fit_context(policy, history, params.max_new_tokens)
            if ids is None:
                print(f"(message too long: it and --rollout.max_new_tokens {params.max_new_tokens} exceed "
                      f"the model's context of {policy.context} tokens; shorten it)", file=stdout, flush=True)
                continue
            (out,), = policy.engine.generate([ids], params)
            reply = policy.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
            history.append({"role": "assistant", "content": reply})
            print(reply, file=stdout, flush=True)
    except KeyboardInterrupt:
        print(file=stdout)
    return history


def fit_context(policy, history: list[dict], max_new_tokens: int) -> list[int] | None:
    """The prompt ids of the next reply to `history`, after dropping its oldest turns (a user turn with the
    reply to it, and so on) until the prompt and `max_new_tokens` fit `policy.context`, said in one note.
    None (the newest message removed from `history`) when that message alone does not fit."""
    from posttrain.utils.log import info

    limit = policy.context if policy.context is not None else float("inf")
    if len(policy.encode(policy.render(history[-1:]))) + max_new_tokens > limit:
        history.pop()
        return None
    ids, dropped = policy.encode(policy.render(history)), 0
    while len(ids) + max_new_tokens > limit:
        n = 2 if history[1]["role"] == "assistant" else 1
        del history[:n]
        dropped += n
        ids = policy.encode(policy.render(history))
    if dropped:
        info(f"note: the conversation outgrew the model's context ({policy.context} tokens, "
             f"{max_new_tokens} of them kept for the reply by --rollout.max_new_tokens): its oldest "
             f"{dropped} turns are left out from now on")
    return ids


if __name__ == "__main__":
    main()
