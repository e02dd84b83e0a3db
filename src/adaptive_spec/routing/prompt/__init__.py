"""What a prompt holds, read for the router: its pieces as a chat template renders them, what a session's server
already holds of it (and what each server's slots and RAM cache hold of prompts), and what a first turn says before
there is a history to measure."""
