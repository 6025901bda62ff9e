"""Structured output: grammars compiled by llguidance or xgrammar (compiler.py, one file per backend) and
followed token by token (request_grammar.py: one matcher per request, its token bitmask applied before the
sampler)."""
