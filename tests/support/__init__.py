"""Helpers and data the test modules share: tiny models and drafters, the DeepSeek-V3 / Kimi-K2.5 twins, the
engines' fakes, wheel sources and layouts, golden files."""
