"""The embedded text the tiny tokenizer is trained on: generated, fixed, no download.

The corpus is a pure function of nothing (a fixed RNG seed), so every tiny model, whatever its
weight seed, shares one vocabulary: a policy built with seed 0 and a reward model built with
seed 1 can score each other's tokens.
"""
from __future__ import annotations

import random

_WORDS = """
the of and to in is it you that he was for on are with as I his they be at one have this from or
had by not word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate hot miss brought heat snow tire bring yes distant fill east paint language among
assistant user system model reward policy value answer question please thanks sorry hello step
solve compute total sum difference product quotient remainder apples oranges books coins dollars
""".split()  # noqa: SIM905 (a word list reads better as text)

_NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Tom", "Sara"]
_ITEMS = ["apples", "oranges", "books", "coins", "pencils", "cookies", "marbles", "stickers", "cards"]
_OPS = [("+", "plus", lambda a, b: a + b), ("-", "minus", lambda a, b: a - b),
        ("*", "times", lambda a, b: a * b)]
_UNICODE = ["café", "naïve", "über", "日本語", "中文", "Ελληνικά", "русский", "😀", "→", "±", "°C", "€5"]
_CODE = ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n",
         '{"answer": 42, "ok": true}', "if a > b and c <= d: pass", "x = [1, 2, 3]  # list"]


def _sentence(rng: random.Random) -> str:
    n = rng.randint(4, 14)
    words = [rng.choice(_WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!", ","])


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 99)
    sym, word, fn = rng.choice(_OPS)
    c = fn(a, b)
    style = rng.randrange(6)
    if style == 0:
        return f"What is {a} {sym} {b}?"
    if style == 1:
        return f"{a} {sym} {b} = {c}"
    if style == 2:
        return f"The answer is {c}."
    if style == 3:
        return f"What is {a} {word} {b}? The answer is \\boxed{{{c}}}."
    if style == 4:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?\n#### {a + b}"
    return f"Q: {a} {sym} {b}\nA: {c}"


def _chat(rng: random.Random) -> str:
    turns = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 2)):
        turns.append(f"<|im_start|>user\n{rng.choice([_arithmetic(rng), _sentence(rng)])}<|im_end|>\n")
        turns.append(f"<|im_start|>assistant\n{_sentence(rng)}<|im_end|>\n")
    return "".join(turns)


def tiny_corpus(num_lines: int = 6000, seed: int = 1234) -> list[str]:
    """Generated lines: English sentences, arithmetic Q/A (digits, + - *, `\\boxed{}`, `####`),
    ChatML conversations, a little code/JSON and non-ASCII text. Same arguments → same lines."""
    rng = random.Random(seed)
    lines = [" ".join(_WORDS), " ".join(str(i) for i in range(1000)), " ".join(_UNICODE)]
    makers = [_sentence] * 5 + [_arithmetic] * 4 + [_chat] * 2
    for _ in range(num_lines):
        lines.append(rng.choice(makers)(rng))
        if rng.random() < 0.02:
            lines.append(rng.choice(_CODE) + " " + rng.choice(_UNICODE))
    return lines
