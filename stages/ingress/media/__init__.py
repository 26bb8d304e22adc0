"""Images in the HTTP APIs (issue 51): from a request's image parts to TokenizeRequest.images.

urls.py reads what a part names (a data: URL's bytes, an http(s) URL that may be fetched);
fetch.py fetches http(s) URLs within --max-image-bytes, --media-fetch-timeout and
--allowed-media-domains; loader.py checks a request's images (the model takes them, their count)
and resolves them all, concurrently, into the ImageData the tokenizer stage decodes.
"""
