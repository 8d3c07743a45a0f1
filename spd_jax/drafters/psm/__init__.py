"""The Pipeline Speculation Module (PSM), SPD's drafter: `model` (config and network), `engine` (the SPD
engine's drafter), `fills` (training's simulated fills, teacher-forced drafts), `objective` (its training
loss, `psm_loss`), `kind` (init, identity, checks, shipped location, cost: the registry entry). The names
below are re-exported for callers."""

from spd_jax.drafters.psm.engine import PSMDrafter
from spd_jax.drafters.psm.fills import (deal_fills, drafts_by_fill, fill_counts, fill_weights, group_sizes,
                                        teacher_states)
from spd_jax.drafters.psm.kind import (FORMAT, KIND, SHIPPED_DIR, PSMCheckpointError, check_spec, init_psm,
                                       load_psm, psm_axes, read_spec, save_psm, shipped_psm, spec_from_json,
                                       spec_to_json)
from spd_jax.drafters.psm.model import PSM, PSMConfig, default_anchors, quarter_anchors, row_types
from spd_jax.drafters.psm.objective import psm_loss
from spd_jax.drafters.shared import target_signature

__all__ = ["FORMAT", "KIND", "PSM", "PSMCheckpointError", "PSMConfig", "PSMDrafter", "SHIPPED_DIR", "check_spec",
           "deal_fills", "default_anchors", "drafts_by_fill", "fill_counts", "fill_weights", "group_sizes",
           "init_psm", "load_psm", "psm_axes", "psm_loss", "quarter_anchors", "read_spec", "row_types", "save_psm",
           "shipped_psm", "spec_from_json", "spec_to_json", "target_signature", "teacher_states"]
