"""The serving-engine versions whose EAGLE-3 loaders the export is checked against (one place).

tests/engine_wheels.py downloads exactly these wheels; tests/test_engine_contract.py parses their
loader source. Bump both here, then run `pytest tests/test_engine_contract.py`: a changed contract
fails loudly there.
"""

ENGINE_VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}
