"""Tests of the test fixtures the package ships: the SGLang test engine and the offline tokenizer."""
