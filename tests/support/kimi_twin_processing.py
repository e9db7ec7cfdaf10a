"""The Kimi-K2.5 twin's processor, copied into the twin directory as processing_kimi_twin.py and named by
processor_config.json's auto_map, so `AutoProcessor.from_pretrained(DIR, trust_remote_code=True)` returns it
(Kimi-K2.5 ships its own remote-code processor the same way).

SGLang's KimiK2_5VLImageProcessor reads `.tokenizer`, `.image_processor` and `.media_processor.media_proc_cfg`
(patch_size, merge_kernel_size, in_patch_limit, patch_limit_on_one_side, image_mean, image_std) at start-up, and
on a GPU preprocesses images itself from that config; only its CPU fallback calls this object with `medias`,
which the twin refuses. Imports: transformers only (transformers checks a remote module's imports).
"""

import json
import math
from pathlib import Path

from transformers import AutoTokenizer

CONFIG_FILE = "processor_config.json"


class KimiTwinMediaProcessor:
    """The image side: the resize config and the image-token count of an image (NaViT-style: scaled to the patch
    limits, padded to whole merged patches, one token per merge_kernel_size**2 patches)."""

    def __init__(self, media_proc_cfg: dict):
        self.media_proc_cfg = dict(media_proc_cfg)

    def media_tokens_calculator(self, media: dict) -> int:
        c = self.media_proc_cfg
        w, h = media["image"].size
        p, m = c["patch_size"], c["merge_kernel_size"]
        scale = min(1.0, math.sqrt(c["in_patch_limit"] / (max(1, w // p) * max(1, h // p))),
                    c["patch_limit_on_one_side"] * p / w, c["patch_limit_on_one_side"] * p / h)
        w, h = max(1, int(w * scale)), max(1, int(h * scale))
        return math.ceil(w / (p * m)) * math.ceil(h / (p * m))


class KimiTwinProcessor:
    """Tokenizer + media processor; text-only calls tokenize."""

    def __init__(self, tokenizer, media_proc_cfg: dict):
        self.tokenizer = tokenizer
        self.media_processor = self.image_processor = KimiTwinMediaProcessor(media_proc_cfg)

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """AutoProcessor calls this on a remote-code class; nothing to register."""

    @classmethod
    def from_pretrained(cls, path, trust_remote_code: bool = False, **kwargs):
        cfg = json.loads((Path(path) / CONFIG_FILE).read_text())["media_proc_cfg"]
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                            revision=kwargs.get("revision"))
        return cls(tok, cfg)

    def __call__(self, text=None, medias=None, **kwargs):
        if medias:
            raise ValueError("the Kimi twin's processor has no CPU image path (SGLang preprocesses images on the GPU)")
        kwargs = {k: v for k, v in kwargs.items() if k in ("padding", "return_tensors")}
        return self.tokenizer(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)
