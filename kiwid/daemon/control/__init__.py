"""What operators and container runtimes ask of kiwid: commands, admission, status, reload."""
