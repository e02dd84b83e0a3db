"""llama-server itself: the patched build adaptive-spec compiles from the pinned llama.cpp source (`build`), and the
`adaptive-spec build-server` command around it."""
