"""The EAGLE-3 chain drafter, in the standard EAGLE-3 architecture: `model` (config, network, the chain
loop's drafter, the weight schema), `kind` (training loss, checkpoints, cost: the registry entry). The
names below are re-exported for callers."""

from spd_jax.drafters.eagle3.kind import (FORMAT, KIND, KIND_NAME, SHIPPED_DIR, TRAINING, Eagle3CheckpointError,
                                          check_spec, eagle3_loss, load_eagle3, read_spec, save_eagle3,
                                          shipped_eagle3, spec_from_json, spec_to_json)
from spd_jax.drafters.eagle3.model import (DraftLayer, Eagle3, Eagle3Config, Eagle3Drafter, default_layers,
                                           drafter_params, eagle3_axes, init_eagle3, layer_schema, weight_schema)

__all__ = ["FORMAT", "KIND", "KIND_NAME", "SHIPPED_DIR", "TRAINING", "DraftLayer", "Eagle3", "Eagle3CheckpointError",
           "Eagle3Config", "Eagle3Drafter", "check_spec", "default_layers", "drafter_params", "eagle3_axes",
           "eagle3_loss", "init_eagle3", "layer_schema", "load_eagle3", "read_spec", "save_eagle3", "shipped_eagle3",
           "spec_from_json", "spec_to_json", "weight_schema"]
