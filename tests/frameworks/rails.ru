# Rails 6.1 upstream for tests/route_agreement.rs: a minimal app with the default
# middleware (Rack::MethodOverride among it) and routes with Rails' (.:format).
# Run: puma -b tcp://127.0.0.1:PORT rails.ru. GET /__count?key=K answers "N handler ...".
require "action_controller/railtie"

RUNS = Hash.new { |h, k| h[k] = [] }
RUNS_LOCK = Mutex.new

class AgreementApp < Rails::Application
  config.load_defaults 6.1
  config.root = __dir__
  config.eager_load = false
  config.secret_key_base = "agreement" * 8
  config.hosts.clear
  config.logger = Logger.new(nil)
  config.log_level = :fatal
  routes.append do
    post "/v1/payments" => "counts#payments"
    post "/v1/orders/:id/pay" => "counts#pay"
    patch "/v1/orders/:id" => "counts#order"
    get "/__count" => "counts#show"
  end
end

AgreementApp.initialize!

class CountsController < ActionController::Base
  skip_forgery_protection

  def payments = ran("payments")
  def pay = ran("pay")
  def order = ran("order")

  def show
    got = RUNS_LOCK.synchronize { RUNS[params[:key].to_s].dup }
    render plain: "#{got.size} #{got.join(" ")}"
  end

  private

  def ran(name)
    RUNS_LOCK.synchronize { RUNS[request.headers["Idempotency-Key"].to_s] << name }
    render plain: "ran #{name}\n", status: 201
  end
end

run AgreementApp
