"""Targets: loading, the EAGLE-3 layer convention, fingerprints."""

from eyas.target.load import (Target, check_aux_layer_ids, default_aux_layer_ids, load_target,
                              target_from_model)

__all__ = ["Target", "check_aux_layer_ids", "default_aux_layer_ids", "load_target", "target_from_model"]
