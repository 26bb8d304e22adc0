"""OpenAI's Responses API (POST /v1/responses and its stored responses), spoken over the chat path.

bodies.py: the request body; items.py: input items to chat messages, a chat answer to output
items; answer.py: the Response object; events.py: a stream's events; store.py: the bounded store
behind previous_response_id, GET and cancel; pages.py: a stored response's input items, paged;
routes.py: the handlers.
"""
