"""The collectives ranks call: observed below the Python API (``observe``), recorded, delayed or failed
(``recorder``), each rank's place in its sequence (``sequence``), and the CPU stand-in for a communication
stream (``comm_worker``)."""
