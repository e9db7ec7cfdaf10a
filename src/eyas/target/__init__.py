"""Targets: loading, the EAGLE-3 layer convention (layers.py), fingerprints."""

from eyas.target.layers import check_aux_layer_ids, default_aux_layer_ids
from eyas.target.load import Target, load_target, target_from_model

__all__ = ["Target", "check_aux_layer_ids", "default_aux_layer_ids", "load_target", "target_from_model"]
