// DSA-TRT TensorRT plugin library: the entry points of libdsa_trt_plugins.so.
//
// One shared object serves every way TensorRT tools load plugins:
//   * plain dlopen (trtexec --staticPlugins, polygraphy --plugins, Triton's plugins=, ctypes.CDLL,
//     linking): a static initialiser registers the seven creators under namespace "dsa" when the
//     library is loaded -- REGISTER_TENSORRT_PLUGIN's mechanism, but passing our namespace (the
//     macro passes "") and remembering what it registered. DSA_TRT_STATIC_REGISTRATION=0 turns it
//     off; initDsaTrtPlugins() then registers explicitly (like initLibNvInferPlugins).
//   * IPluginRegistry::loadLibrary (trtexec --dynamicPlugins, setPluginsToSerialize / version-
//     compatible plans, Python registry.load_library): TensorRT dlopens the library, calls
//     getCreators() and registers what it returns, failing if any of them is already registered.
//     getCreators() therefore first withdraws the registrations the static initialiser made, so
//     the creators pass to TensorRT, owned by the library handle (deregisterLibrary removes them).
//   * setLoggerFinder(): TensorRT's logger for our messages (plugin_common.cpp).
#include "plugin_common.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace dsa_trt
{
namespace
{

constexpr size_t kNbCreators = 7;

std::array<nv::IPluginCreatorInterface*, kNbCreators> const& allCreators() noexcept
{
    static std::array<nv::IPluginCreatorInterface*, kNbCreators> const list = {
        &mlaCacheWriteCreator(),
        &indexerKCacheWriteCreator(),
        &indexerLogitsCreator(),
        &topkTranslateCreator(),
        &sparseMlaCreator(),
        &fp8BlockLinearCreator(),
        &moeExpertsCreator(),
    };
    return list;
}

std::mutex gRegistrationMutex;
std::array<bool, kNbCreators> gRegisteredByUs{}; // registerCreator calls of ours still in force

char const* creatorName(nv::IPluginCreatorInterface* c) noexcept
{
    return static_cast<nv::IPluginCreatorV3One*>(c)->getPluginName();
}

// Registers every creator not yet registered by us. False if the registry is missing or refused
// one (typically: another copy of this library already registered it).
bool registerAll() noexcept
{
    std::lock_guard<std::mutex> const lock(gRegistrationMutex);
    nv::IPluginRegistry* registry = ::getPluginRegistry();
    if (registry == nullptr)
    {
        logMessage(nv::ILogger::Severity::kERROR, "dsa_trt_plugins: getPluginRegistry() returned null");
        return false;
    }
    bool ok = true;
    for (size_t i = 0; i < kNbCreators; ++i)
    {
        if (gRegisteredByUs[i])
            continue;
        nv::IPluginCreatorInterface* creator = allCreators()[i];
        gRegisteredByUs[i] = registry->registerCreator(*creator, kPluginNamespace);
        ok = ok && gRegisteredByUs[i];
        logMessage(gRegisteredByUs[i] ? nv::ILogger::Severity::kVERBOSE : nv::ILogger::Severity::kWARNING,
            std::string(gRegisteredByUs[i] ? "registered " : "could not register (already registered?) ")
                + kPluginNamespace + "::" + creatorName(creator) + " version " + kPluginVersion);
    }
    return ok;
}

// Hands the statically registered creators back so that loadLibrary can register them itself.
void withdrawOwnRegistrations() noexcept
{
    std::lock_guard<std::mutex> const lock(gRegistrationMutex);
    nv::IPluginRegistry* registry = nullptr;
    for (size_t i = 0; i < kNbCreators; ++i)
    {
        if (!gRegisteredByUs[i])
            continue;
        registry = registry != nullptr ? registry : ::getPluginRegistry();
        if (registry != nullptr)
            registry->deregisterCreator(*allCreators()[i]);
        gRegisteredByUs[i] = false;
    }
}

bool staticRegistrationEnabled() noexcept
{
    char const* env = std::getenv("DSA_TRT_STATIC_REGISTRATION");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

struct StaticRegistration
{
    StaticRegistration() noexcept
    {
        if (staticRegistrationEnabled())
            registerAll();
    }
};

StaticRegistration const gStaticRegistration;

} // namespace
} // namespace dsa_trt

// Built with -fvisibility=hidden: these three are the library's whole dynamic interface.
// (TensorRT's TENSORRTAPI expands to nothing unless TENSORRT_BUILD_LIB is defined.)
#define DSA_TRT_EXPORT __attribute__((visibility("default")))

extern "C"
{
    // For IPluginRegistry::loadLibrary: the creators of this library, now unregistered.
    DSA_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
    {
        dsa_trt::withdrawOwnRegistrations();
        nbCreators = static_cast<int32_t>(dsa_trt::kNbCreators);
        return dsa_trt::allCreators().data();
    }

    DSA_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
    {
        dsa_trt::setLoggerFinder(finder);
    }

    // Explicit registration under namespace "dsa" (idempotent), for processes that set
    // DSA_TRT_STATIC_REGISTRATION=0. Returns false if any creator could not be registered.
    DSA_TRT_EXPORT bool initDsaTrtPlugins()
    {
        return dsa_trt::registerAll();
    }
}
