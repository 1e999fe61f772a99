from asyncrl.cli import app

app()
