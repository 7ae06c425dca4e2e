"""Conversation sources, the packaged validation prompts and the training input pipeline."""
