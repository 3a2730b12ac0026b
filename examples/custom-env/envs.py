"""Higher or lower: find a number in 0..high within `guesses` turns, told higher/lower each turn."""

import numpy as np


class HigherLower:
    def __init__(self, high: int = 15, guesses: int = 5) -> None:
        self.high, self.guesses = high, guesses

    def reset(self, seed: int) -> str:  # the same seed must give the same episode
        self.target = int(np.random.default_rng(seed).integers(self.high + 1))
        self.lo, self.hi, self.turns = 0, self.high, 0
        return f"guess 0-{self.high}:"

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.turns += 1
        guess = int(action) if action.strip().isdecimal() else -1  # unparsable: a wasted turn
        won, low = guess == self.target, guess < self.target
        if 0 <= guess and low:  # what the hints so far rule out (the expert's interval)
            self.lo = max(self.lo, guess + 1)
        elif 0 <= guess:
            self.hi = min(self.hi, guess - 1)
        done = won or self.turns >= self.guesses
        obs = "" if done else ("higher:" if low else "lower:")
        return obs, float(won), done, {"success": won, "state": (self.lo, self.hi)}

    def expert_action(self, rng: np.random.Generator) -> str:  # for SFT: binary search
        return str((self.lo + self.hi) // 2)

    def random_action(self, rng: np.random.Generator) -> str:  # for SFT's noisy demonstrations
        return str(int(rng.integers(self.high + 1)))
