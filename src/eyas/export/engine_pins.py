"""The serving-engine versions whose EAGLE-3 and DFlash loaders the export is checked against (one place).

tests/support/engine_wheels.py downloads exactly these wheels; tests/test_engine_contract.py (EAGLE-3) and
tests/test_dflash_contract.py (DFlash) parse their loader source. Bump both here, then run
`pytest tests/test_engine_contract.py tests/test_dflash_contract.py`: a changed contract fails loudly there.
"""

ENGINE_VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}
