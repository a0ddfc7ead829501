"""What stands between a user's request and a backend (the engine in this process, or a pipeline's
driver): the run of requests from added to their results (:mod:`~stagewise.frontend.run`, with the
:class:`~stagewise.frontend.run.Backend` protocol it drives, and :mod:`~stagewise.frontend.local`,
the engine as one), prompts and chat templates (:mod:`~stagewise.frontend.prompts`), images into
``pixel_values`` (:mod:`~stagewise.frontend.image_processing`), and each request's text: streaming
detokenisation and stop strings (:mod:`~stagewise.frontend.text`,
:mod:`~stagewise.frontend.detokenize`). A rank needs none of it: the tokenizer stays here."""
