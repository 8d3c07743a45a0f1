"""The analytic cost model: FLOPs and bytes of the SPD cycle (`cycle`) and of the baselines' steps
(`baselines`), every (stage, model) split of a device count (`factorisations`), bytes per device
(`memory`), hardware profiles (`hardware`) and their calibration on published figures (`calibration`), and
the measured cycle profile a CPU profile is fitted to (`profile`). It reads layers through
`spd_jax.models` and drafters only through their kind (`drafters.kind.DrafterKind`: `cost`, `params`)."""
