"""The analytic cost model: FLOPs and bytes of the SPD cycle (`cycle`) and of the baselines' steps
(`baselines`), every (stage, model) split of a device count (`factorisations`), bytes per device
(`memory`), hardware profiles (`hardware`) and their calibration on published figures (`calibration`), and
the measured cycle profile a CPU profile is fitted to (`profile`). It reads layers through their kinds
(`spd_jax.models.kinds`) and a drafter's costs and weights through its kind (`drafters.kind.DrafterKind`:
`cost`, `params`, `random_config`); `profile` times the PSM as the engine runs it."""
