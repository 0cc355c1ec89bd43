"""Disaggregation between workers: KV blocks (P/D, ``kv_transfer``: held blocks, the transfer
server, pulls), encoder outputs (E/P/D: ``ec_transfer``, and its engine component
``encoder_disaggregation``) and who may use the transfer server (``transfer_auth``)."""
