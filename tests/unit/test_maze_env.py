"""MazeEnv: generation invariants, reproducibility and step semantics.

Only what the module docstring documents is relied on; the exact observation layout is not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gyre.config import ConfigError, load_config
from gyre.envs.maze import MOVES, MazeEnv, Teacher, bfs_distances, parse_action

CONFIGS = [
    {"size": 5, "wall_density": 0.3, "min_distance": 4, "budget_factor": 2.0},
    {"size": 5, "wall_density": 0.2, "min_distance": 5, "budget_factor": 1.5},
    {"size": 7, "wall_density": 0.3, "min_distance": 6, "budget_factor": 1.0},
    {"size": 6, "wall_density": 0.0, "min_distance": 4, "budget_factor": 1.3},
]


def _target(env: MazeEnv, move: str) -> tuple[int, int]:
    dr, dc = MOVES[move]
    return env.pos[0] + dr, env.pos[1] + dc


def _inside(env: MazeEnv, rc: tuple[int, int]) -> bool:
    return 0 <= rc[0] < env.size and 0 <= rc[1] < env.size


def _find(predicate, env: MazeEnv, seeds=range(300)):
    """First (seed, move) whose start position satisfies predicate(env, move)."""
    for seed in seeds:
        env.reset(seed)
        for move in MOVES:
            if predicate(env, move):
                return seed, move
    raise AssertionError("no seed in range has the wanted configuration")


# -- helpers ----------------------------------------------------------------------------------
def test_bfs_distances_hand_grid():
    walls = np.array(
        [
            [0, 0, 0],
            [1, 1, 0],
            [0, 0, 0],
        ],
        dtype=bool,
    )
    dist = bfs_distances(walls, (2, 0))
    expected = np.array(
        [
            [6, 5, 4],
            [-1, -1, 3],
            [0, 1, 2],
        ]
    )
    np.testing.assert_array_equal(dist, expected)


def test_bfs_unreachable_is_minus_one():
    walls = np.array([[0, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=bool)
    dist = bfs_distances(walls, (2, 2))
    assert dist[0, 0] == -1  # boxed in by walls
    assert dist[0, 1] == -1 and dist[1, 1] == -1  # walls
    assert dist[0, 2] == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("u", "u"),
        (" D \n", "d"),
        ("up", "u"),
        ("LEFT", "l"),
        ("  Right", "r"),
        ("down\n", "d"),
        ("jump", None),
        ("", None),
        ("xyz", None),
        ("ud", None),
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text) == expected


# -- generation -------------------------------------------------------------------------------
@pytest.mark.parametrize("params", CONFIGS)
def test_generated_mazes_are_solvable_and_budgeted(params):
    env = MazeEnv(**params)
    assert env.size >= 5
    for seed in range(40):
        env.reset(seed)
        assert env.walls.shape == (env.size, env.size)
        assert not env.walls[env.start] and not env.walls[env.goal]
        assert env.start != env.goal
        shortest = int(bfs_distances(env.walls, env.goal)[env.start])
        assert shortest != -1, "goal must be reachable"
        assert shortest == env.shortest
        assert shortest >= params["min_distance"]
        assert env.budget == math.floor(params["budget_factor"] * shortest)
        assert shortest <= env.budget <= 2 * shortest


def test_same_seed_same_maze():
    a, b = MazeEnv(size=6), MazeEnv(size=6)
    for seed in (0, 1, 17, 2**31 + 5):
        obs_a, obs_b = a.reset(seed), b.reset(seed)
        np.testing.assert_array_equal(a.walls, b.walls)
        assert (a.start, a.goal, a.budget) == (b.start, b.goal, b.budget)
        assert obs_a == obs_b


def test_different_seeds_give_different_mazes():
    env = MazeEnv()
    layouts = set()
    for seed in range(20):
        env.reset(seed)
        layouts.add((env.walls.tobytes(), env.start, env.goal))
    assert len(layouts) >= 15


def test_reset_is_deterministic_after_play():
    env = MazeEnv()
    first = env.reset(11)
    walls = env.walls.copy()
    env.step("jump")
    env.step(next(iter(MOVES)))
    again = env.reset(11)
    assert again == first
    np.testing.assert_array_equal(env.walls, walls)
    assert env.pos == env.start and env.moves == 0 and not env.done


@pytest.mark.parametrize(("observation", "view"), [("grid", 2), ("window", 1), ("window", 2)])
def test_full_observations_have_one_agent(observation, view):
    env = MazeEnv(view=view, observation=observation)
    rng = np.random.default_rng(0)
    for seed in range(10):
        obs = env.reset(seed)
        assert isinstance(obs, str) and obs.count("A") == 1
        while not env.done:
            obs, _, _, _ = env.step(env.random_action(rng))
            assert obs.count("A") == 1 and obs.endswith(">")


def _expected_view(env: MazeEnv) -> str:
    cells = []
    for dr, dc in MOVES.values():
        r, c = env.pos[0] + dr, env.pos[1] + dc
        if not _inside(env, (r, c)) or env.walls[r, c]:
            cells.append("#")
        elif (r, c) == env.goal:
            cells.append("G")
        else:
            cells.append("+" if (r, c) in env.visited else ".")
    gr, gc = env.goal[0] - env.pos[0], env.goal[1] - env.pos[1]
    offset = f"{'u' if gr < 0 else 'd'}{abs(gr)}{'l' if gc < 0 else 'r'}{abs(gc)}"
    return "".join(cells) + offset + ">"


def test_compass_observation_matches_documented_format():
    env = MazeEnv()  # observation="compass" is the default
    rng = np.random.default_rng(1)
    for seed in range(10):
        first = env.reset(seed)
        lines = first.split("\n")
        grid, view = lines[:-1], lines[-1]
        assert len(grid) == env.size and all(len(row) == env.size for row in grid)
        assert "".join(grid).count("A") == 1 and "".join(grid).count("G") == 1
        r, c = env.pos
        assert grid[r][c] == "A" and grid[env.goal[0]][env.goal[1]] == "G"
        assert view == _expected_view(env)
        while not env.done:
            obs, _, _, _ = env.step(env.random_action(rng))
            assert obs == _expected_view(env)  # later turns: only the agent's view


def _expected_exits(env: MazeEnv) -> str:
    """The exits view written from the compass one: each non-wall neighbour's letter + cell."""
    compass = _expected_view(env)
    cells, offset = compass[:4], compass[4:-1]
    opened = "".join(name + cell for name, cell in zip(MOVES, cells, strict=True) if cell != "#")
    return opened + " " + offset + ">"


def test_exits_observation_matches_documented_format():
    env = MazeEnv(observation="exits")
    rng = np.random.default_rng(2)
    for seed in range(10):
        first = env.reset(seed)
        lines = first.split("\n")
        grid, view = lines[:-1], lines[-1]
        assert len(grid) == env.size and "".join(grid).count("A") == 1
        assert grid[env.pos[0]][env.pos[1]] == "A"
        assert view == _expected_exits(env)
        while not env.done:
            obs, _, _, _ = env.step(env.random_action(rng))
            assert obs == _expected_exits(env)
            # every letter before the space is a move that is not blocked
            for name in obs.split(" ")[0][::2]:
                assert _inside(env, _target(env, name)) and not env.walls[_target(env, name)]


def test_exits_observation_looks_one_or_two_moves_ahead():
    with pytest.raises(ValueError, match="view"):
        MazeEnv(observation="exits", view=3)


def _free(env: MazeEnv, cell: tuple[int, int]) -> bool:
    return _inside(env, cell) and not env.walls[cell]


def test_exits_view_2_lists_onward_moves_without_the_way_back():
    """view=2: the goal offset, then every open move, its cell and the moves open from that
    neighbour in upper case (never the way back); checked against the walls directly, on every
    turn of random walks."""
    env = MazeEnv(observation="exits", view=2)
    rng = np.random.default_rng(3)
    back = {"u": "d", "d": "u", "l": "r", "r": "l"}
    seen_dead_end = False
    for seed in range(20):
        obs = env.reset(seed).split("\n")[-1]
        while True:
            assert obs.endswith(">")
            offset, *entries = obs[:-1].split(" ")
            assert offset + ">" == _expected_view(env)[4:]  # the goal offset comes first
            expected = []
            for name in MOVES:
                nb = _target(env, name)
                if not _free(env, nb):
                    continue
                onward = "".join(
                    m.upper()
                    for m, (dr, dc) in MOVES.items()
                    if m != back[name] and _free(env, (nb[0] + dr, nb[1] + dc))
                )
                cell = "G" if nb == env.goal else "+" if nb in env.visited else "."
                expected.append(name + cell + onward)
                seen_dead_end |= onward == "" and cell != "G"
            assert entries == expected
            if env.done:
                break
            obs, _, _, _ = env.step(env.random_action(rng))
    assert seen_dead_end  # the walks met at least one dead end (an entry with no onward move)


def test_visited_cells_are_marked():
    env = MazeEnv()

    def free_non_goal(e, m):
        t = _target(e, m)
        return _inside(e, t) and not e.walls[t] and t != e.goal

    seed, move = _find(free_non_goal, env)
    env.reset(seed)
    start = env.pos
    back = {"u": "d", "d": "u", "l": "r", "r": "l"}[move]
    _, _, done, _ = env.step(move)
    assert not done  # the budget is at least 8 moves
    obs, _, _, _ = env.step(back)
    assert env.pos == start
    assert obs[list(MOVES).index(move)] == "+"  # the cell we came back from is marked visited


def test_unknown_observation_rejected():
    with pytest.raises(ValueError, match="compass"):
        MazeEnv(observation="pixels")


def test_invalid_budget_factor_rejected():
    with pytest.raises(ValueError):
        MazeEnv(budget_factor=2.5)
    with pytest.raises(ValueError):
        MazeEnv(budget_factor=0.5)


def test_config_requires_size_at_least_five():
    with pytest.raises(ConfigError, match=r"env\.maze\.size"):
        load_config(None, ["env.maze.size=4"])
    assert load_config(None, ["env.maze.size=5"]).env.maze.size == 5


# -- step semantics ---------------------------------------------------------------------------
def test_grid_edge_blocks_move_and_counts():
    env = MazeEnv()
    seed, move = _find(lambda e, m: not _inside(e, _target(e, m)), env)
    env.reset(seed)
    start = env.pos
    obs, reward, done, info = env.step(move)
    assert env.pos == start
    assert env.moves == 1 and info["moves"] == 1
    assert reward == 0.0 and not done and not info["malformed"]
    assert obs == _expected_view(env)


def test_wall_blocks_move_and_counts():
    env = MazeEnv()

    def into_wall(e, m):
        t = _target(e, m)
        return _inside(e, t) and bool(e.walls[t])

    seed, move = _find(into_wall, env)
    env.reset(seed)
    start = env.pos
    _, reward, done, info = env.step(move.upper())
    assert env.pos == start
    assert env.moves == 1
    assert reward == 0.0 and not done and not info["malformed"]
    assert info["bumps"] == 1  # counted as a bump; a malformed or a free move is not
    _, _, _, info = env.step("jump")
    assert info["bumps"] == 1 and info["malformed"]


def test_free_move_changes_position():
    env = MazeEnv()

    def free(e, m):
        t = _target(e, m)
        return _inside(e, t) and not e.walls[t]

    seed, move = _find(free, env)
    env.reset(seed)
    target = _target(env, move)
    _, _, _, info = env.step(move)
    assert env.pos == target and env.moves == 1 and info["bumps"] == 0


@pytest.mark.parametrize(("word", "letter"), [("up", "u"), ("LEFT", "l"), (" Down ", "d")])
def test_word_actions_accepted(word, letter):
    env = MazeEnv()

    def free(e, m):
        t = _target(e, m)
        return m == letter and _inside(e, t) and not e.walls[t]

    seed, _ = _find(free, env)
    env.reset(seed)
    target = _target(env, letter)
    _, _, _, info = env.step(word)
    assert env.pos == target
    assert not info["malformed"]


@pytest.mark.parametrize("bad", ["jump", "", "xyz"])
def test_malformed_action_is_a_wasted_move(bad):
    env = MazeEnv()
    env.reset(3)
    start = env.pos
    _, reward, done, info = env.step(bad)
    assert env.pos == start
    assert env.moves == 1 and info["moves"] == 1
    assert info["malformed"] is True
    assert reward == 0.0 and not done


def test_budget_exhaustion_ends_with_zero_reward():
    env = MazeEnv()
    env.reset(5)
    budget = env.budget
    assert budget >= 8
    for k in range(1, budget + 1):
        _, reward, done, info = env.step("jump")
        assert reward == 0.0
        assert info["moves"] == k
        assert done == (k == budget)
    assert info["success"] is False
    assert info["budget"] == budget
    with pytest.raises(RuntimeError):
        env.step("u")


@pytest.mark.parametrize("params", CONFIGS)
def test_expert_reaches_goal_in_shortest_moves(params):
    env = MazeEnv(**params)
    rng = np.random.default_rng(0)
    for seed in range(5):
        env.reset(seed)
        dist = bfs_distances(env.walls, env.goal)
        total, moves, done, info = 0.0, 0, False, {}
        while not done:
            before = int(dist[env.pos])
            _, reward, done, info = env.step(env.expert_action(rng))
            assert int(dist[env.pos]) == before - 1
            total += reward
            moves += 1
            if not done:
                assert reward == 0.0
        assert reward == 1.0 and total == 1.0
        assert info["success"] is True
        assert moves == env.shortest == info["moves"]
        assert env.pos == env.goal
        with pytest.raises(RuntimeError):
            env.step("u")


def test_goal_on_last_budget_move_still_rewarded():
    # budget_factor=1 gives budget == shortest: the winning move is also the last one allowed.
    env = MazeEnv(budget_factor=1.0)
    env.reset(2)
    assert env.budget == env.shortest
    rng = np.random.default_rng(1)
    done, reward, info = False, 0.0, {}
    while not done:
        _, reward, done, info = env.step(env.expert_action(rng))
    assert reward == 1.0 and info["success"] is True and env.moves == env.budget


def test_step_before_reset_raises():
    with pytest.raises(RuntimeError):
        MazeEnv().step("u")


def test_random_action_is_well_formed():
    env = MazeEnv()
    env.reset(0)
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert parse_action(env.random_action(rng)) is not None


def test_compass_offsets_rings():
    from gyre.envs.maze import compass_offsets

    assert compass_offsets(1) == [(-1, 0), (1, 0), (0, -1), (0, 1)]
    two = compass_offsets(2)
    assert len(two) == 12 and two[:4] == compass_offsets(1)
    assert two[4:] == [(-2, 0), (-1, -1), (-1, 1), (0, -2), (0, 2), (1, -1), (1, 1), (2, 0)]
    env = MazeEnv(view=2)
    env.reset(3)
    view = env.step("jump")[0]
    assert len(view) == 12 + 4 + 1 and view.endswith(">")


def test_evaluation_reports_the_bump_fraction(tokenizer):
    """``eval/bump_frac_greedy`` = wall bumps / moves over the evaluated episodes, checked by
    replaying the same always-"u" policy by hand."""
    from chat_helpers import ScriptedEngine
    from gyre.rollout.evaluate import EvalSettings, eval_seeds, evaluate

    nl = tokenizer.convert_tokens_to_ids("\n")
    engine = ScriptedEngine(tokenizer, ["u"], nl)
    m = evaluate(engine, MazeEnv, tokenizer, 20, EvalSettings(1.0, 4, sampled=False))
    bumps = moves = 0
    for seed in eval_seeds(20):
        env, done = MazeEnv(), False
        env.reset(seed)
        while not done:
            _, _, done, info = env.step("u")
        bumps, moves = bumps + info["bumps"], moves + info["moves"]
    assert 0 < bumps < moves
    assert m["eval/bump_frac_greedy"] == pytest.approx(bumps / moves)


def test_greedy_demonstrator_never_bumps_and_solves_about_sixty_percent():
    wins = 0
    for seed in range(300):
        env, done = MazeEnv(teacher=Teacher("greedy")), False
        env.reset(seed)
        while not done:
            gr, gc = env.goal
            before = abs(gr - env.pos[0]) + abs(gc - env.pos[1])
            legal = [m for m in "udlr" if _inside(env, _target(env, m))
                     and not env.walls[_target(env, m)]]  # fmt: skip
            dists = {m: abs(gr - _target(env, m)[0]) + abs(gc - _target(env, m)[1]) for m in legal}
            move = env.expert_action(None)
            assert dists[move] == min(dists.values()) and before > 0
            _, _, done, info = env.step(move)
        assert info["bumps"] == 0
        wins += info["success"]
    assert 0.5 < wins / 300 < 0.7  # 59.5 % on 2,000 held-out mazes


def _hand_walls() -> np.ndarray:
    """The hand maze of the demonstrator and noise tests (``#`` a wall; row 0 is all free)."""
    grid = [".....", "####.", "#....", "##.##", "##..."]
    return np.array([[ch == "#" for ch in row] for row in grid])


def test_lookahead_demonstrator_skips_a_dead_end_that_greedy_enters():
    """A hand maze: the agent at (2, 2), the goal at (0, 0). Left leads to (2, 1), a dead end
    (walls above, below and to its left) that is closer to the goal; down and right lead on.
    greedy goes left, lookahead down (ties in the order u, d, l, r). In a dead end both take
    the only move, the way out; the goal itself is never treated as a dead end."""
    walls = _hand_walls()
    env = {
        d: MazeEnv(view=2, observation="exits", teacher=Teacher(d)) for d in ("greedy", "lookahead")
    }
    for e in env.values():
        e.walls, e.goal, e.pos = walls, (0, 0), (2, 2)
    assert env["greedy"].expert_action(None) == "l"
    assert env["lookahead"].expert_action(None) == "d"
    for e in env.values():
        e.pos = (2, 1)  # inside the dead end: the only legal move leads out
        assert e.expert_action(None) == "r"
        e.pos = (0, 1)  # next to the goal, a cell with nothing open beyond it: still taken
        assert e.expert_action(None) == "l"


def test_lookahead_demonstrator_never_bumps_and_beats_greedy():
    wins = {"greedy": 0, "lookahead": 0}
    for d in wins:
        for seed in range(300):
            env, done = MazeEnv(view=2, observation="exits", teacher=Teacher(d)), False
            env.reset(seed)
            while not done:
                _, _, done, info = env.step(env.expert_action(None))
            assert info["bumps"] == 0
            wins[d] += info["success"]
    # 1,000 held-out mazes: greedy 58.8 %, lookahead 66.2 %
    assert wins["lookahead"] > wins["greedy"] + 9
    assert 0.6 < wins["lookahead"] / 300 < 0.75


def test_unknown_demonstrator_rejected():
    with pytest.raises(ValueError, match="demonstrator"):
        MazeEnv(teacher=Teacher("oracle"))


TEACHERS = ("lookahead", "careful")


def test_careful_demonstrator_prefers_unvisited_cells_and_solves_about_ninety_percent():
    """careful = lookahead, then an unvisited cell before a visited one. Hand maze: the agent
    at (2, 2), the goal at (0, 4) behind a wall row with a gap at (1, 4); right (2, 3) is
    closer and visited, down (3, 2) farther and new: lookahead goes right, careful down. On
    300 mazes it never bumps and solves far more than lookahead (1,000 held-out: 92.8 %)."""
    walls = _hand_walls()  # the goal cell is no wall: (0, 4) is free like (0, 0)
    env = {d: MazeEnv(view=2, observation="exits", teacher=Teacher(d)) for d in TEACHERS}
    for e in env.values():
        e.walls, e.goal, e.pos, e.visited = walls, (0, 4), (2, 2), {(2, 2), (2, 3)}
    assert env["lookahead"].expert_action(None) == "r"
    assert env["careful"].expert_action(None) == "d"
    env["careful"].visited = {(2, 2)}  # nothing visited nearby: greedy's choice again
    assert env["careful"].expert_action(None) == "r"
    wins = 0
    for seed in range(300):
        e, done = MazeEnv(view=2, observation="exits", teacher=Teacher("careful")), False
        e.reset(seed)
        while not done:
            _, _, done, info = e.step(e.expert_action(None))
        assert info["bumps"] == 0
        wins += info["success"]
    assert wins / 300 > 0.85


class _PartialCreditEnv:
    """One turn; the reply scores 1/(seed % 4 + 1) and never succeeds: partial credit only."""

    def reset(self, seed: int) -> str:
        self.seed = seed
        return "q>"

    def step(self, text: str) -> tuple[str, float, bool, dict]:
        return "", 1.0 / (self.seed % 4 + 1), True, {"success": False}

    def expert_action(self, rng: np.random.Generator) -> str:
        return "u"

    random_action = expert_action


def test_evaluation_reports_the_mean_reward_beside_success(tokenizer):
    """``eval/reward_greedy`` is the mean return over the same held-out seeds: the score of a
    reward that gives partial credit (reasoning-gym), which the success rate (0 here) hides."""
    from chat_helpers import ScriptedEngine
    from gyre.rollout.evaluate import EvalSettings, demonstrator_success, eval_seeds, evaluate

    engine = ScriptedEngine(tokenizer, ["u"], tokenizer.convert_tokens_to_ids("\n"))
    m = evaluate(engine, _PartialCreditEnv, tokenizer, 12, EvalSettings(1.0, 4, sampled=False))
    want = np.mean([1.0 / (s % 4 + 1) for s in eval_seeds(12)])
    assert m["eval/success_greedy"] == 0.0
    assert 0.0 < want < 1.0 and m["eval/reward_greedy"] == pytest.approx(want)
    demo = demonstrator_success(_PartialCreditEnv, 12)  # the table's reference line, too
    assert demo is not None and demo["eval/reward_greedy"] == pytest.approx(want)


def test_mixed_teacher_draws_each_turns_demonstrator_with_its_probability():
    """env.maze.demonstrator_mix: in the hand state where lookahead goes right and careful down
    (the test above), demonstrator=lookahead with {careful: 0.3} says down on about 30 % of
    draws, one rng draw a turn; an empty mix never touches the rng (old demonstrations stay
    bit-identical); on 300 mazes the mixed teacher sits between its two rules."""
    walls = _hand_walls()
    env = MazeEnv(teacher=Teacher("lookahead", {"careful": 0.3}))
    env.walls, env.goal, env.pos, env.visited = walls, (0, 4), (2, 2), {(2, 2), (2, 3)}
    rng = np.random.default_rng(0)
    moves = [env.expert_action(rng) for _ in range(4000)]
    assert set(moves) == {"r", "d"}
    assert moves.count("d") / 4000 == pytest.approx(0.3, abs=0.03)
    u = np.random.default_rng(0).random(4000)  # the same draws, in order
    assert moves == ["d" if x < 0.3 else "r" for x in u]
    plain, rng = MazeEnv(teacher=Teacher("lookahead")), np.random.default_rng(1)
    plain.walls, plain.goal, plain.pos, plain.visited = walls, (0, 4), (2, 2), env.visited
    plain.expert_action(rng)
    assert rng.random() == np.random.default_rng(1).random()  # no draw without a mix

    def wins(mix: dict[str, float] | None, demonstrator: str = "greedy") -> float:
        rng, won = np.random.default_rng(0), 0
        for seed in range(300):
            e, done = MazeEnv(teacher=Teacher(demonstrator, mix)), False
            e.reset(seed)
            while not done:
                _, _, done, info = e.step(e.expert_action(rng))
            won += info["success"]
        return won / 300

    greedy, mixed, careful = wins(None), wins({"careful": 0.35}), wins(None, "careful")
    assert greedy + 0.1 < mixed < careful  # 500 held-out: 58.4, 80.8, 93.0 %


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("env.maze.demonstrator_mix={careful: 1.5}", "demonstrator_mix.careful=1.5"),
        ("env.maze.demonstrator_mix={careful: 0.6, lookahead: 0.6}", "sums to more than 1"),
        ("env.maze.demonstrator_mix={oracle: 0.5}", "bad key .oracle. in .env.maze.demo"),
    ],
)
def test_a_bad_mixed_teacher_is_a_one_line_error(override, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, [override])
    with pytest.raises(ValueError, match="demonstrator_mix"):
        MazeEnv(teacher=Teacher("shortest", {"careful": 0.7, "greedy": 0.7}))
