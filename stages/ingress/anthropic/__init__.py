"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat path.

bodies.py decodes Anthropic's request bodies; translate.py turns one into a chat request (the
chat route's own parse_chat validates it, so tools, tool_choice, stop strings and sampling mean
the same on both routes); reply.py shapes a finished chat answer as an Anthropic message,
stream.py a streamed one as Anthropic's events; errors.py is the error shape of these paths;
routes.py holds the handlers. No second generation path: GenerateRoutes.run does the work.
"""
