"""A bounded fuzz of the config parser: random dotted overrides over every key the config has
(``describe_fields``, so a new field is covered without touching this file), with values of
random types. Every outcome must be a valid :class:`Config` or a :class:`ConfigError` whose
message is one line naming a key -- never another exception."""

from __future__ import annotations

import random
import re

from gyre.config import Config, ConfigError, describe_fields, load_config

LEAVES = [line.split(" = ", 1)[0] for line in describe_fields()]
SECTIONS = sorted({leaf.rsplit(".", 1)[0] for leaf in LEAVES if "." in leaf})
KNOWN = set(LEAVES) | set(SECTIONS)

# What a user might type after 'key=' -- every YAML type, and the values that broke runs.
VALUES = [
    "0", "1", "-1", "2", "3", "7", "100000", "-100000", "1" * 40, "-" + "9" * 400,
    "0.0", "-0.0", "0.5", "1e-9", "1e20", "1.0e20", "1e308", "-1e308", "1.5", "0.01",
    "nan", "NaN", ".nan", "inf", "-inf", ".inf", "-.inf", "Infinity",
    "true", "false", "on", "off", "yes", "no", "null", "~", "",
    "abc", "cpu", "cuda", "cuda:0", "auto", "bogus", "é", "'quoted'", '"dq"', "a:b", "x" * 300,
    "[]", "[1, 2]", "[nan]", "['a', 'b']", "{}", "{a: 1}", "{fn: 'm:f'}", "[{fn: 'm:f'}]",
    "{[1]: 2}", "{a: 1, a: 2}", "[1, [2, [3]]]", "&a [*a]", "!!binary aGk=", "!!python/none",
    "{", "]", ": :", "- - -", "%", "@", "`",
]  # fmt: skip


def _key(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.75:
        return rng.choice(LEAVES)
    if r < 0.85:
        return rng.choice(SECTIONS)
    base = rng.choice(LEAVES)
    return rng.choice([base + "x", base + ".deeper", "nosuch." + base, base.replace(".", "..")])


def _value(rng: random.Random) -> str:
    if rng.random() < 0.15:  # a random number of a random magnitude and sign
        return repr(rng.choice([-1, 1]) * 10 ** rng.uniform(-12, 40))
    return rng.choice(VALUES)


def _names_a_key(msg: str, keys: list[str]) -> bool:
    """Some dotted name in ``msg`` is a config key, or one of the given keys / a key under it."""
    given = {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 2)}
    names = re.findall(r"[A-Za-z_]\w*(?:\.\w+)*", msg)
    return any(n in KNOWN or n in keys or any(n.startswith(g + ".") for g in given) for n in names)


def test_random_overrides_give_a_config_or_a_one_line_error():
    rng = random.Random(20240601)
    outcomes = {"valid": 0, "error": 0}
    for case in range(600):  # valid configs are ~3 % of draws: enough of both sides
        items = [f"{_key(rng)}={_value(rng)}" for _ in range(rng.randint(1, 3))]
        try:
            cfg = load_config(None, items)
        except ConfigError as exc:
            msg = str(exc)
            assert msg and "\n" not in msg, (case, items, msg)
            assert _names_a_key(msg, [i.split("=", 1)[0] for i in items]), (case, items, msg)
            outcomes["error"] += 1
        else:  # anything else raised fails the test with the case in the traceback
            assert isinstance(cfg, Config)
            outcomes["valid"] += 1
    # the fuzz explores both sides (a generator that only makes errors would test little)
    assert outcomes["valid"] >= 10 and outcomes["error"] >= 300, outcomes
