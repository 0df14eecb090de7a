"""The model families the worker loads, one module each (`family.Family` says what a module declares). To add one:
write its module (config mapping, tensor names, what its layers compute differently), list it in
`registry.FAMILIES`, and test it against `transformers` on a tiny random model (as tests/model/test_qwen3.py
does); docs/architecture.md says where each part goes."""
