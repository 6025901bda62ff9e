"""Structured output: grammars compiled with xgrammar (compiler.py) and followed token by token
(request_grammar.py: one matcher per request, its token bitmask applied by the sampler)."""
