"""The Textual dashboard; it talks to the local daemon over its Unix socket."""
