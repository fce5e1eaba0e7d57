"""Tie-aware comparison of two greedy generations (token ids + top-2 logprobs per step)."""

from __future__ import annotations

#: Two correct float32 MLA decoders agree to a few 1e-6 in logprob (facts measured on this
#: engine); 1e-3 is the issue's bound.
LOGPROB_ATOL = 1e-3
#: A greedy flip is accepted only where the reference's two best tokens are this close.
NEAR_TIE = 1e-3


def compare_generations(ours: dict, ref: dict, logprob_atol: float = LOGPROB_ATOL,
                        near_tie: float = NEAR_TIE) -> list[str]:
    """Problems found (empty when the generations agree).

    Tokens must be equal step by step; a divergence is accepted only at an exact near-tie in
    the reference (after it, the sequences legitimately differ and are not compared).
    Logprobs of the reference's token must agree to ``logprob_atol`` up to that point.
    """
    problems = []
    assert len(ours["prompts"]) == len(ref["prompts"])
    for i, (a, b) in enumerate(zip(ours["prompts"], ref["prompts"], strict=True)):
        for step, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"], strict=True)):
            ref_lp, our_lp = b["logprobs"][step], a["logprobs"][step]
            key = str(tb)
            if key in our_lp and abs(our_lp[key] - ref_lp[key]) > logprob_atol:
                problems.append(
                    f"prompt {i} (len {b['prompt_len']}) step {step}: logprob of {tb} "
                    f"{our_lp[key]:.6f} vs {ref_lp[key]:.6f}"
                )
            if ta != tb:
                best = sorted(ref_lp.values(), reverse=True)[:2]
                if len(best) < 2 or best[0] - best[1] > near_tie:
                    problems.append(
                        f"prompt {i} (len {b['prompt_len']}) step {step}: token {ta} vs "
                        f"{tb} where the reference is not a near-tie ({best})"
                    )
                break
    return problems


def compare_schedules(ours: dict, ref: dict) -> list[str]:
    """Problems if the two runs did not batch their requests identically step by step.

    vLLM CPU's float32 numbers depend on the batch mix (1e-2 and more in logprob), so two
    backends are comparable only on identical schedules (``run_engine``'s ``schedule``).
    """
    a, b = ours.get("schedule"), ref.get("schedule")
    if a is None or b is None:
        return ["a run recorded no schedule"]
    for step, (x, y) in enumerate(zip(a, b, strict=False)):  # length checked below
        if x != y:
            return [f"step {step} batched {x} vs {y} in the reference"]
    if len(a) != len(b):
        return [f"{len(a)} steps vs {len(b)} in the reference"]
    return []


def agreement(ours: dict, ref: dict) -> dict[str, float]:
    """How much two generations could be compared: the steps up to each prompt's first
    divergence (inclusive) out of all steps, and the largest logprob difference of the
    reference's token over those steps."""
    compared = total = 0
    worst = 0.0
    for a, b in zip(ours["prompts"], ref["prompts"], strict=True):
        total += len(b["token_ids"])
        for step, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"], strict=True)):
            compared += 1
            ours_lp = a["logprobs"][step].get(str(tb))
            if ours_lp is not None:
                worst = max(worst, abs(ours_lp - b["logprobs"][step][str(tb)]))
            if ta != tb:
                break
    return {"compared_steps": compared, "total_steps": total,
            "compared_fraction": compared / max(total, 1), "max_logprob_diff": worst}
