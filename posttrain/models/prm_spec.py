"""How a process reward model reads its steps: the placeholder token that ends each step, the reward tokens
(good first) and the separator between a response's steps. `posttrain prm` writes it beside config.json as
``prm.json``; RL (`--reward.prm`) reads it from the reward model's folder, and flags may set or override it
(a PRM trained elsewhere, e.g. Math-Shepherd's: placeholder ``ки``, reward tokens ``+`` ``-``)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from posttrain.utils.errors import UserError

PRM_SPEC_FILE = "prm.json"


@dataclass(frozen=True)
class PRMSpec:
    placeholder_token: str
    reward_tokens: list[str] = field(default_factory=lambda: ["+", "-"])
    step_separator: str = "\n"

    def problem(self) -> str | None:
        """What makes the description unusable (one line), else None: fewer than two reward tokens, one
        named twice (every step would score 0.5), the placeholder among them, an empty separator."""
        tokens = list(self.reward_tokens)
        if len(tokens) < 2 or len(set(tokens)) != len(tokens):
            return f"reward tokens {tokens}: a PRM needs at least two distinct reward tokens (good first)"
        if self.placeholder_token in tokens:
            return f"the placeholder {self.placeholder_token!r} is also a reward token"
        return None if self.step_separator else "the step separator is empty"

    def token_ids(self, tokenizer) -> tuple[int, list[int]]:
        """(placeholder id, reward-token ids) in `tokenizer`; each must be exactly one token, the reward
        tokens distinct ids, and the placeholder must stay its own token where `render_steps` puts it (after
        a space, before the separator: a BPE may merge it there); else a UserError naming the token."""
        from posttrain.algorithms.process_reward import render_steps

        placeholder = one_token_id(tokenizer, self.placeholder_token, "placeholder token")
        rewards = [one_token_id(tokenizer, t, "reward token") for t in self.reward_tokens]
        if len(set(rewards)) != len(rewards):
            raise UserError(f"the reward tokens {list(self.reward_tokens)} are {rewards} in this tokenizer: "
                            "two are the same token")
        text = render_steps("", ["1", "2"], self.placeholder_token, self.step_separator)
        if tokenizer.encode(text, add_special_tokens=False).count(placeholder) != 2:
            raise UserError(f"the placeholder token {self.placeholder_token!r} merges with the text around "
                            f"it in this tokenizer ({text!r} does not hold it twice as a token): choose a "
                            "token that stays one piece after a space and before the separator")
        return placeholder, rewards


def one_token_id(tokenizer, token: str, what: str) -> int:
    """The id of `token` in `tokenizer` (`what` names it in the error: a UserError when it is not one
    token)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        raise UserError(f"the {what} {token!r} is {len(ids)} tokens in this tokenizer ({pieces}); a PRM "
                        "reads one token per step: choose a token the tokenizer has as one piece")
    return ids[0]


def save_prm_spec(folder, spec: PRMSpec) -> None:
    with open(os.path.join(folder, PRM_SPEC_FILE), "w") as f:
        json.dump(asdict(spec), f, indent=1)


def load_prm_spec(folder) -> PRMSpec | None:
    """The folder's PRMSpec, or None when it has no ``prm.json``; a file that does not hold one is a
    UserError naming the file."""
    path = os.path.join(os.path.expanduser(str(folder)), PRM_SPEC_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return PRMSpec(**json.load(f))
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"{path}: not a PRM description ({e}); it holds {{\"placeholder_token\": ..., "
                        "\"reward_tokens\": [...], \"step_separator\": ...}") from None
