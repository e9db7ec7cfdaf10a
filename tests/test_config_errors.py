"""Every stage config refuses a bad value with the one error type (EyasError, which the CLI prints as one line and
exit 2), not a bare ValueError."""

import pytest

from eyas.bench.bench import BenchConfig
from eyas.capture.capture import CaptureConfig
from eyas.data.prepare import PrepareConfig
from eyas.data.regenerate import RegenConfig
from eyas.decode.spec import SpecConfig
from eyas.engines.client import EngineCaptureConfig
from eyas.errors import EyasError
from eyas.model.drafter import DrafterConfig
from eyas.train.config import TrainConfig
from eyas.train.ttt import TTTConfig

BAD = [
    (PrepareConfig, {"out": "P", "max_len": 1}),
    (RegenConfig, {"regen_temperature": -1.0}),
    (CaptureConfig, {"out": "S", "dtype": "int4"}),
    (TrainConfig, {"out": "R", "store": "S", "epochs": 0}),
    (TTTConfig, {"num_steps": 0}),
    (DrafterConfig, {"hidden_size": 0, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 2,
                     "intermediate_size": 4, "vocab_size": 8, "draft_vocab_size": 8, "target_hidden_size": 4,
                     "rms_norm_eps": 1e-5, "rope_theta": 1e4, "max_position_embeddings": 64,
                     "aux_layer_ids": (0, 1, 2)}),
    (SpecConfig, {"top_p": 0.0}),
    (BenchConfig, {"max_new_tokens": 0}),
    (EngineCaptureConfig, {"engine": "tgi", "url": "http://127.0.0.1:1", "data": "P", "out": "S"}),
]


@pytest.mark.parametrize("cls,kw", BAD, ids=[c.__name__ for c, _ in BAD])
def test_bad_value_raises_eyas_error(cls, kw):
    with pytest.raises(EyasError) as e:
        cls(**kw)
    assert type(e.value) is EyasError and "\n" not in str(e.value)
