"""Groups scored a second by the rollout worker's scorer (issue 53, item 4), with its event loop idle or busy.

Near convergence a step keeps few groups, so the worker generates and scores many: on an H100 SmolLM2-135M's
real-model row scored ~105 groups/s at 85-94% of groups dropped, its scoring queue full (rollout/score_block_s
1.5-2.5 s a step), while vLLM sat idle. The worker scores on the same event loop that streams every completion, and a
sync reward function runs in a thread that must win the GIL back from that loop at each step.

This runs ``score_group`` (asyncrl/rollout/scoring.py) with the recipes' ``accuracy`` and ``format`` rewards on
groups of 8 answers to two-operand sums (most right, some off by one, as a model near convergence answers), one group
at a time or several at once (rollout.score_concurrency), while a coroutine keeps the loop busy for a chosen share of
each millisecond.

    python benchmarks/scoring_rate.py                       # loop idle and 80% busy, 1 and 4 at once, 5 s each
    python benchmarks/scoring_rate.py --busy 0,0.5,0.9 --prompts 64

``--prompts``: how many distinct prompts the groups cycle through (few: a run revisiting its prompts; many: fresh
answers). Prints one line per busy share; writes scoring_rate.json under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from asyncrl.rewards.accuracy import Accuracy, AccuracyOptions
from asyncrl.rewards.format import Format
from asyncrl.rollout.scoring import RewardSource, score_group
from asyncrl.rollout.types import RolloutGroup


def arithmetic_group(a: int, b: int, rng: random.Random, size: int = 8) -> RolloutGroup:
    """A group of ``size`` boxed answers to ``a + b``: mostly right, some off by one."""
    prompt = [{"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}]
    answers = [a + b + rng.choice((0, 0, 0, 1, -1)) for _ in range(size)]
    return RolloutGroup(
        prompts=[prompt] * size,
        reward_kwargs={"solution": [str(a + b)] * size},
        completions=[[{"role": "assistant", "content": f"The sum is \\boxed{{{x}}}."}] for x in answers],
        completions_ids=[[0]] * size,
        completions_sequences=[[] for _ in range(size)],
        tool_call_counts=[0] * size,
        tool_failure_counts=[0] * size,
        model_version=0,
        group_id=0,
        row_index=0,
        env_rewards=[None] * size,
        rollout_rewards=[None] * size,
    )


async def keep_busy(share: float, stop: asyncio.Event) -> None:
    """Hold the loop ``share`` of each millisecond, as the worker's streaming does."""
    while not stop.is_set():
        until = time.perf_counter() + 0.001 * share
        while time.perf_counter() < until:
            pass
        await asyncio.sleep(0.001 * (1 - share))


async def groups_per_s(share: float, prompts: int, seconds: float, seed: int, concurrency: int = 1) -> float:
    """Groups scored a second by ``concurrency`` scorers (rollout.score_concurrency) with the loop ``share`` busy."""
    rng = random.Random(seed)
    operands = [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(prompts)]
    sources = [RewardSource("accuracy", Accuracy(AccuracyOptions())), RewardSource("format", Format())]
    warm_up = (score_group(arithmetic_group(1, 1, rng), sources) for _ in range(concurrency))
    await asyncio.gather(*warm_up)  # start the verifier children outside the timing
    stop = asyncio.Event()
    busy = asyncio.create_task(keep_busy(share, stop))
    started, scored = time.perf_counter(), 0

    async def scorer() -> None:
        nonlocal scored
        while time.perf_counter() - started < seconds:
            scored += 1
            await score_group(arithmetic_group(*operands[scored % prompts], rng), sources)

    await asyncio.gather(*(scorer() for _ in range(concurrency)))
    stop.set()
    await busy
    return scored / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", default="0,0.8", help="comma-separated shares of the loop kept busy")
    parser.add_argument("--prompts", type=int, default=100_000, help="distinct prompts the groups cycle through")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", default="1,4", help="comma-separated groups scored at once")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = []
    for share in (float(s) for s in args.busy.split(",")):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            rate = asyncio.run(groups_per_s(share, args.prompts, args.seconds, args.seed, concurrency))
            rows.append({"busy": share, "prompts": args.prompts, "concurrency": concurrency,
                         "groups_per_s": round(rate, 1)})  # fmt: skip
            print(f"loop busy {share:.0%}, {args.prompts} prompts, {concurrency} at once: {rate:,.0f} groups/s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scoring_rate.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
