"""Placeholder: filled by the losses issues."""
