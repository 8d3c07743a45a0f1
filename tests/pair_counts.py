"""Seeded two-token generations in a process of its own, with as many host devices as stages (the test
session has 8; tests/test_sixteen.py runs n = 16 here), their counts as JSON on stdout:

    python tests/pair_counts.py N MODEL METHOD RUNS PROMPT_IDS [--accept-every-draft]

Every run samples (temperature 1, top-k 4) from a random drafter (spd's PSM of one layer, ppsd's head) at
n = N stages with seed 0 .. RUNS-1; --accept-every-draft switches on the engine's deliberately wrong rule
(the control a chi-square test must reject)."""

import json
import sys
from collections import Counter

import jax
from spd_jax.decode.sampling import Sampling
from spd_jax import methods


def main(argv: list[str]) -> None:
    n, model_path, method, runs, prompt = int(argv[0]), argv[1], argv[2], int(argv[3]), argv[4]
    jax.config.update("jax_num_cpu_devices", n)  # before the backend starts
    import spd_jax
    from spd_jax.decode import spd as engine

    engine._TEST_ACCEPT_EVERY_DRAFT = "--accept-every-draft" in argv[5:]
    model = spd_jax.load_model(model_path)
    ids = [int(t) for t in prompt.split(",")]
    counts = Counter()
    for seed in range(runs):
        pair = spd_jax.generate(model, ids, 2, sampling=Sampling(temperature=1.0, top_k=4, seed=seed),
                                method=methods.get(method).taking(n=n, spec="random", drafter_spec="random", psm_layers=1),
                                stop_at_eos=False).token_ids
        counts[",".join(map(str, pair))] += 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main(sys.argv[1:])
