"""The server's defaults, in a module of their own so that the command line can show them without the server's
extra (``pip install 'draftwise[serve]'``) installed."""

#: Requests that may wait for a slot before new ones are refused.
DEFAULT_MAX_WAITING = 256
#: Tokens generated when a request names no limit (cut to the room left in the context window).
DEFAULT_MAX_TOKENS = 256
