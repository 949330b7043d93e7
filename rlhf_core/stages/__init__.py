"""Stage entry points: one function per ``rlhf stage NAME``; each reads params, writes its outputs."""
