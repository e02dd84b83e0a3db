"""The llama-server binary: the pinned build with adaptive-spec's patches, a build from a user's own
llama.cpp tree, what a binary can do, and the CPU faults a machine's binary may hit."""
