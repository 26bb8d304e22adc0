"""Rejected: a request the tokenizer stage refuses, sent to its ingress as a 400 in the OpenAI
error shape (`param`: the request field at fault, `code`: OpenAI's code where it has one). Raised
by every step of preparation: encoding, length limits, output constraints, images."""

from __future__ import annotations


class Rejected(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
